"""moe feature of megatron_ext."""
