"""replay feature of megatron_ext."""
