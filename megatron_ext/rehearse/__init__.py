"""Rehearsals on this machine's CPUs: ``megatron-ext demo`` (:mod:`.demo`), ``megatron-ext rehearse``
(:mod:`.matrix`), and what both launch ranks with (:mod:`.local_launch`: 2 gloo ranks of
``python -m megatron_ext.pretrain_gpt``, forked from :mod:`.rank_server`, each with torchrun's
environment, :mod:`.rank_env`)."""
