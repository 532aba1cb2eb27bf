"""Per-run state of a ``megatron_ext.pretrain_gpt`` job: validated configs, load metrics, replay bindings.

Megatron's ``pretrain`` takes plain functions (model provider, datasets provider, forward step) and hands
them ``get_args()``; the state those functions share lives in one :class:`RunState`, created from the parsed
arguments the first time any of them asks, and dropped with :func:`reset` (tests, a new run). Nothing else in
megatron_ext keeps run state at module level.

Example::

    cfgs = configs(args)               # {PaddingConfig: ..., MoEAlignmentConfig: ..., ...}
    metrics = load_metrics(args)       # ExpertLoadMetrics or None
"""

import argparse
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_ext.arguments import configs_from_args
from megatron_ext.config import MoEAlignmentConfig, ReplayConfig


@dataclass
class RunState:
    """What the providers and the forward step of one run share."""

    args_id: int
    configs: dict[type, Any]
    load_metrics: Any = None
    replay_bindings: list[Any] = field(default_factory=list)
    micro_batches_seen: int = 0
    last_load_summary: Optional[dict[str, Any]] = None


_STATE: Optional[RunState] = None


def state(args: argparse.Namespace) -> RunState:
    """The run's state, built (and validated) from ``args`` on first use."""
    global _STATE
    if _STATE is None or _STATE.args_id != id(args):
        _STATE = RunState(args_id=id(args), configs=configs_from_args(args))
    return _STATE


def configs(args: argparse.Namespace) -> dict[type, Any]:
    """Validated megatron_ext configs of this run."""
    return state(args).configs


def load_metrics(args: argparse.Namespace) -> Any:
    """The run's ``ExpertLoadMetrics`` when ``--moe-expert-load-metrics`` is on, else None."""
    run = state(args)
    if run.load_metrics is None and run.configs[MoEAlignmentConfig].moe_expert_load_metrics:
        from megatron_ext.moe.load_metrics import ExpertLoadMetrics

        run.load_metrics = ExpertLoadMetrics(args.num_experts, args.expert_model_parallel_size)
    return run.load_metrics


def bind_replay(model: Any, replay: ReplayConfig) -> Any:
    """Binds route replay (or record) to a freshly built model stage; returns the binding."""
    from megatron.training import get_args

    from megatron_ext.replay.binding import RouteReplayBinding

    binding = RouteReplayBinding(
        model,
        replay.route_replay_mode,
        missing_route_policy=replay.replay_missing_route_policy,
    )
    state(get_args()).replay_bindings.append(binding)
    return binding


def replay_binding(args: argparse.Namespace) -> Any:
    """The replay binding of this rank's model (None when replay is off)."""
    bindings = state(args).replay_bindings
    if len(bindings) > 1:
        raise ValueError("route replay with virtual pipeline stages is not supported yet")
    return bindings[0] if bindings else None


def reset() -> None:
    """Forgets the run's state (between runs in one process, e.g. tests)."""
    global _STATE
    _STATE = None
