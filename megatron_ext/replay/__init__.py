"""replay feature of megatron_ext.

``megatron_ext.replay.RouteReplay`` (imported on first use, so the pure modules of this package
stay free of megatron): engine routes replayed in any training loop
(:mod:`~megatron_ext.replay.route_replay`).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "RouteReplay":
        from megatron_ext.replay.route_replay import RouteReplay

        return RouteReplay
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
