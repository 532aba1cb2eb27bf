"""Transformer Engine's attributes stood in, as Megatron binds them where TE imports (a GPU node)."""
