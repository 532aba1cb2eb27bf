"""Test infrastructure: gloo rank pools with Megatron parallel state, a host-sync detector, a tiny model.

``tiny_moe_config`` / ``build_tiny_gpt`` import Megatron and are loaded lazily.
"""

from typing import Any

from megatron_ext.testing.distributed import run_distributed, sequence_parallel
from megatron_ext.testing.host_sync import assert_no_host_sync, count_host_syncs, record_host_syncs

__all__ = [
    "assert_no_host_sync",
    "build_tiny_gpt",
    "count_host_syncs",
    "record_host_syncs",
    "run_distributed",
    "sequence_parallel",
    "tiny_moe_config",
]


def __getattr__(name: str) -> Any:
    if name in ("tiny_moe_config", "build_tiny_gpt"):
        from megatron_ext.testing import tiny_model

        return getattr(tiny_model, name)
    raise AttributeError(name)
