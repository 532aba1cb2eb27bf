"""training feature of megatron_ext."""
