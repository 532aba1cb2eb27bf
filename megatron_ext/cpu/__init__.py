"""The CPU rehearsal: Megatron-Core's real MoE stack and training loop on CPU over gloo, applied
only under ``--cpu`` or by tests. Every change to Megatron's behaviour is a row of
:mod:`megatron_ext.compat`; importing this package patches nothing."""
