"""What several megatron_ext features share, owned by none of them (pure os, numpy and torch; never
imports megatron or a feature package; docs/architecture.md lists the modules).
"""
