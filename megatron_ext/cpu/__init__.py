"""The CPU rehearsal: what makes Megatron-Core's real MoE stack (:mod:`.model_stack`) and training loop
(:mod:`.training_loop`) run on CPU over gloo, applied only under ``--cpu`` or by tests, with the CPU
allocator setting (:mod:`.caching_malloc`) and the local norms (:mod:`.local_norms`). Every change to
Megatron's behaviour is a row of :mod:`megatron_ext.compat`. Importing this package patches nothing.
"""
