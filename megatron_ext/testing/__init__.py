"""Test infrastructure: gloo rank pools with Megatron parallel state, a host-sync detector, a tiny model.

Every name is loaded on first use (they import torch, some Megatron), so importing a submodule
that needs neither (``real_loop``: the tiny launch's flags) stays cheap. Nothing a user runs
imports this package (tests/test_layout.py); the rehearsal's launcher is
:mod:`megatron_ext.rehearse.local_launch`.
"""

from typing import Any

__all__ = [
    "assert_no_host_sync",
    "build_tiny_gpt",
    "count_host_syncs",
    "record_host_syncs",
    "run_distributed",
    "sequence_parallel",
    "tiny_moe_config",
]


_HOMES = {
    "run_distributed": "distributed",
    "sequence_parallel": "distributed",
    "assert_no_host_sync": "host_sync",
    "count_host_syncs": "host_sync",
    "record_host_syncs": "host_sync",
    "tiny_moe_config": "tiny_model",
    "build_tiny_gpt": "tiny_model",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"megatron_ext.testing.{_HOMES[name]}"), name)
