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
from typing import Any

from megatron_ext.arguments import configs_from_args
from megatron_ext.config import MoEAlignmentConfig, ReplayConfig


@dataclass
class RunState:
    """What the providers and the forward step of one run share."""

    args_id: int
    configs: dict[type, Any]
    load_metrics: Any = None
    replay_bindings: list[Any] = field(default_factory=list)
    iteration: int | None = None
    position: int = 0
    eval_forwards: int = 0
    last_load_summary: dict[str, Any] | None = None
    record_dataset: Any = None
    recorded_packs: list[tuple[list[int], Any]] = field(default_factory=list)
    #: ``--cpu`` with fp8/fp4: the quantized precision the MoE layers rehearse (cpu_rehearsal).
    rehearsal: dict[str, Any] | None = None
    rehearsal_log: Any = None
    replay_check: Any = None
    #: ``--moe-pad-routing`` resolved for this run, with the per-micro-batch real-token counts.
    pad_routing: Any = None


_STATE: RunState | None = None


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


def pad_routing(args: argparse.Namespace) -> Any:
    """The run's ``PadRouting`` (``--moe-pad-routing`` resolved against Megatron's flags); None for a
    dense model."""
    run = state(args)
    if run.pad_routing is None and getattr(args, "num_experts", None):
        from megatron_ext.config import MoEPadRoutingConfig
        from megatron_ext.moe.pad_routing import PadRouting

        config = run.configs[MoEPadRoutingConfig]
        mode, _ = config.resolve(args)
        run.pad_routing = PadRouting(mode, required=config.moe_pad_routing == "skip")
    return run.pad_routing


def bind_replay(model: Any, replay: ReplayConfig) -> Any:
    """Binds route replay (or record) to a freshly built model stage; returns the binding."""
    from megatron.training import get_args

    from megatron_ext.replay.binding import RouteReplayBinding

    binding = RouteReplayBinding(
        model,
        replay.route_replay_mode,
        missing_route_policy=replay.replay_missing_route_policy,
    )
    run = state(get_args())
    run.replay_bindings.append(binding)
    if replay.route_replay_check:
        from megatron_ext.replay.replay_check import ReplayCheck

        run.replay_check = run.replay_check or ReplayCheck()
        run.replay_check.attach(binding)
    return binding


def replay_binding(args: argparse.Namespace) -> Any:
    """The replay binding of this rank's model (None when replay is off)."""
    bindings = state(args).replay_bindings
    if len(bindings) > 1:
        raise ValueError("route replay with virtual pipeline stages is not supported yet")
    return bindings[0] if bindings else None


def record_routes(
    args: argparse.Namespace, binding: Any, key: Any, pack_index: Any, batch_shape: tuple[int, int]
) -> None:
    """Keeps the routes the forward of micro-batch ``key`` chose, per pack (record mode).

    ``batch_shape`` is the data layout ``[B, S]``; the model may have run it flattened (THD).
    NOTE: device-to-host sync (the recorded routes and pack indices go to the host); record mode only.
    """
    routes = binding.recorded_routes(key)
    routes_BSLK = routes.reshape(*batch_shape, *routes.shape[2:])
    state(args).recorded_packs.append((pack_index.tolist(), routes_BSLK.cpu().numpy()))


def finish_recording(args: argparse.Namespace) -> int | None:
    """Gathers every data-parallel rank's recorded packs to rank 0 and writes the route sidecar.

    Routes are already complete on every rank of a model-parallel group (``recorded_routes`` gathers over
    TP/CP/PP), so only the data-parallel group's distinct packs are merged. Returns the number of
    documents written on the writing rank, else None.
    """
    import torch
    from megatron.core import parallel_state

    from megatron_ext.replay.route_dataset import RouteRecorder

    run = state(args)
    replay = run.configs[ReplayConfig]
    if replay.route_replay_mode != "record":
        return None
    packs = run.recorded_packs
    group = parallel_state.get_data_parallel_group()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(gathered, packs, group=group)
        packs = [pack for part in gathered for pack in part]
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    if run.record_dataset is None:
        raise ValueError("--route-replay-mode record: no dataset was built to record against")
    recorder = RouteRecorder.for_dataset(run.record_dataset)
    for pack_indices, routes_BSLK in packs:
        for b, pack in enumerate(pack_indices):
            recorder.add_pack(run.record_dataset.pack_pieces(pack), routes_BSLK[b])
    return recorder.write(replay.route_record_path)


def reset() -> None:
    """Forgets the run's state (between runs in one process, e.g. tests)."""
    global _STATE
    _STATE = None
