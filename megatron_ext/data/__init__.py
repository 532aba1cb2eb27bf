"""data feature of megatron_ext."""
