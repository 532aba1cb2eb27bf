"""Per-run state of a ``megatron_ext.pretrain_gpt`` job: validated configs, load metrics, replay bindings.

Nothing else in megatron_ext keeps run state at module level. Example::

    cfgs = configs(args)               # {PaddingConfig: ..., MoEAlignmentConfig: ..., ...}
    metrics = load_metrics(args)       # ExpertLoadMetrics or None
"""

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.common.micro_batch import MicroBatchContext
from megatron_ext.config.megatron_view import MegatronView, TrainingProgress
from megatron_ext.training.arguments import configs_from_args
from megatron_ext.training.feature_configs import MoEAlignmentConfig, ReplayConfig


@dataclass
class RunState:
    """What the providers and the forward step of one run share."""

    args_id: int
    configs: dict[type, Any]
    #: Megatron's flags as parsed, for what reads them per micro-batch (the loss guards); what
    #: Megatron sets later (the padded vocabulary, the iteration) is read where it is needed.
    parsed: MegatronView = field(default_factory=MegatronView)
    load_metrics: Any = None
    #: One replay binding per model chunk (virtual pipeline stage) that holds a MoE router.
    replay_bindings: list[Any] = field(default_factory=list)
    #: The micro-batch the model runs (begun by the forward step; read by replay, pad skipping and
    #: the load metrics, in forward and in recompute).
    micro_batches: MicroBatchContext = field(default_factory=MicroBatchContext)
    iteration: int | None = None
    #: Per model chunk (virtual pipeline stage, 0 without): the next training micro-batch's index
    #: in the step, and the evaluation forwards so far.
    positions: dict[int, int] = field(default_factory=dict)
    eval_forwards: dict[int, int] = field(default_factory=dict)
    last_load_summary: dict[str, Any] | None = None
    record_dataset: Any = None
    #: Record mode: this rank's streaming ``RouteRecorder`` (None until the first recorded pack, and
    #: off global rank 0's data-parallel group, which holds the same routes).
    route_recorder: Any = None
    #: Record mode with --rl-record-logprobs: this rank's ``LogprobRecorder`` (policy_step).
    logprob_recorder: Any = None
    #: ``--cpu`` with fp8/fp4: the quantized precision the MoE layers rehearse (cpu_rehearsal).
    rehearsal: dict[str, Any] | None = None
    rehearsal_log: Any = None
    replay_check: Any = None
    #: Replay: the training packs' route coverage was checked (and logged) by this launch. Megatron
    #: builds the datasets once per virtual pipeline stage; the data is the same each time.
    route_coverage_checked: bool = False
    #: ``--moe-pad-routing`` resolved for this run, with the per-micro-batch real-token counts.
    pad_routing: Any = None
    #: This rank's host token counts since the last log, the interval's start, the last record.
    token_counts: Any = None
    token_clock: float = 0.0
    last_throughput: dict[str, Any] | None = None


# Module level because Megatron's pretrain takes plain functions (model provider, datasets provider,
# forward step) and hands them only get_args(): the state they share is keyed by that object.
_STATE: RunState | None = None


def state(args: argparse.Namespace) -> RunState:
    """The run's state, built (and validated) from ``args`` on first use."""
    global _STATE
    if _STATE is None or _STATE.args_id != id(args):
        _STATE = RunState(
            args_id=id(args), configs=configs_from_args(args), parsed=MegatronView.from_args(args)
        )
    return _STATE


def configs(args: argparse.Namespace) -> dict[type, Any]:
    """Validated megatron_ext configs of this run."""
    return state(args).configs


def load_metrics(args: argparse.Namespace) -> Any:
    """The run's ``ExpertLoadMetrics`` when ``--moe-expert-load-metrics`` is on, else None."""
    run = state(args)
    if run.load_metrics is None and run.configs[MoEAlignmentConfig].moe_expert_load_metrics:
        from megatron_ext.moe.load_metrics import ExpertLoadMetrics

        run.load_metrics = ExpertLoadMetrics(
            args.num_experts, args.expert_model_parallel_size, micro_batches=run.micro_batches
        )
    return run.load_metrics


def pad_routing(args: argparse.Namespace) -> Any:
    """The run's ``PadRouting`` (``--moe-pad-routing`` resolved against Megatron's flags); None for a
    dense model."""
    run = state(args)
    if run.pad_routing is None and MegatronView.from_args(args).num_experts:
        from megatron_ext.moe.pad_routing import PadRouting
        from megatron_ext.training.feature_configs import MoEPadRoutingConfig

        config = run.configs[MoEPadRoutingConfig]
        mode, _ = config.resolve(args)
        run.pad_routing = PadRouting(
            mode, required=config.moe_pad_routing == "skip", micro_batches=run.micro_batches
        )
    return run.pad_routing


def bind_replay(model: Any, replay: ReplayConfig) -> Any:
    """Binds route replay (or record) to a freshly built model chunk (a pipeline stage, or one
    virtual stage of it); returns the binding, or None for a chunk whose layers are all dense (no
    router: nothing to replay there)."""
    from megatron.training import get_args

    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.replay.keyed_router_replay import replayed_routers

    if not replayed_routers(model):
        return None
    run = state(get_args())
    binding = RouteReplayBinding(
        model,
        replay.route_replay_mode,
        missing_route_policy=replay.replay_missing_route_policy,
        micro_batches=run.micro_batches,
    )
    run.replay_bindings.append(binding)
    if replay.route_replay_check:
        from megatron_ext.replay.replay_check import ReplayCheck

        if run.replay_check is None:  # pads skipped: the MoE layer clears their routes
            pads = pad_routing(get_args())
            run.replay_check = ReplayCheck(
                replay.replay_missing_route_policy, pads_skipped=pads is not None and pads.skip
            )
        run.replay_check.attach(binding)
    return binding


def replay_binding(args: argparse.Namespace, model: Any) -> Any:
    """The replay binding of the model chunk ``model`` (possibly wrapped); None when replay is
    off or the chunk has no MoE router."""
    from megatron_ext.replay.keyed_router_replay import unwrap_model

    chunk = unwrap_model(model)
    return next((b for b in state(args).replay_bindings if any(c is chunk for c in b.chunks)), None)


def record_routes(
    args: argparse.Namespace,
    binding: Any,
    key: Any,
    pack_index: Any,
    batch_shape: tuple[int, int],
    pad_mask_BS: Any = None,
) -> None:
    """Streams the routes the forward of micro-batch ``key`` chose, per pack, to disk (record mode).

    Args:
        batch_shape: The data layout ``[B, S]``; the model may have run it flattened (THD).
        pad_mask_BS: True = pad (the batch's ``padding_mask``): pad rows are written as missing
            (a "skip pads" MoE layer routes pads nowhere, so what it chose is no route).

    NOTE: device-to-host sync (the recorded routes, pack indices and pad mask go to the host); record
    mode only.
    """
    # recorded_routes gathers over TP/CP/PP, a collective every rank joins, so routes are complete
    # on every rank of a model-parallel group: only global rank 0's data-parallel group streams,
    # rank r of it to <--route-record-path>.dp<r>.pieces/.rows (_record_stream).
    routes = binding.recorded_routes(key)
    recorder = _record_stream(args)
    if recorder is None:
        return
    routes_BSLK = routes.reshape(*batch_shape, *routes.shape[2:]).cpu().numpy()
    pads_BS = None if pad_mask_BS is None else pad_mask_BS.reshape(batch_shape).cpu().numpy()
    dataset = state(args).record_dataset
    doc_multiple = dataset.config.doc_pad_multiple  # where each pack's real tokens sit
    for b, pack in enumerate(pack_index.tolist()):
        pad_mask_S = None if pads_BS is None else pads_BS[b]
        recorder.add_pack(dataset.pack_pieces(pack), routes_BSLK[b], pad_mask_S, doc_multiple)


def _record_stream(args: argparse.Namespace) -> Any:
    """This rank's route recorder, created on first use; None off global rank 0's DP group."""
    from megatron_ext.replay.route_recorder import RouteRecorder, record_streams

    run = state(args)
    if run.route_recorder is not None:
        return run.route_recorder
    if run.record_dataset is None:
        raise ValueError("--route-replay-mode record: no dataset was built to record against")
    dp_rank, _, streams = record_streams(run.configs[ReplayConfig].route_record_path)
    if dp_rank is None:
        return None
    from megatron_ext.replay.layout import moe_layer_numbers_for_args

    run.route_recorder = RouteRecorder.for_dataset(
        run.record_dataset,
        stream=streams[dp_rank],
        moe_layer_ids=[n - 1 for n in moe_layer_numbers_for_args(args)],  # 1-based -> 0-based
    )
    return run.route_recorder


def check_record_directory(args: argparse.Namespace) -> None:
    """Record mode, at setup: the data-parallel ranks that stream routes share
    ``--route-record-path``'s directory, where rank 0 assembles their streams at the end; a run
    that resumed from a checkpoint is refused. Collective over that group; other ranks return.

    Raises:
        ValueError: On every rank of that group, naming ``--route-record-path``.
    """
    import os

    import torch

    from megatron_ext.replay.route_recorder import record_streams
    from megatron_ext.replay.shared_directory import check_shared_directory

    replay = state(args).configs[ReplayConfig]
    if replay.route_replay_mode != "record":
        return
    resumed_at = TrainingProgress.from_args(args).iteration  # set by Megatron's checkpoint load
    if resumed_at > 0:
        load = MegatronView.from_args(args).load
        raise ValueError(
            f"--route-replay-mode record cannot resume from the checkpoint at iteration "
            f"{resumed_at} (--load {load}): the routes recorded before it "
            "are in no stream of this run, so their documents would end up missing. Record from "
            "the start (--finetune loads the weights without resuming)"
        )
    if not torch.distributed.is_initialized():
        return
    dp_rank, _, streams = record_streams(replay.route_record_path)
    if dp_rank is None or len(streams) == 1:
        return
    from megatron.core import parallel_state

    path = os.path.abspath(replay.route_record_path)
    check_shared_directory(
        os.path.dirname(path),
        dp_rank,
        len(streams),
        group=parallel_state.get_data_parallel_group(),
        prefix=os.path.basename(path),
        path=replay.route_record_path,
    )


def finish_recording(args: argparse.Namespace) -> int | None:
    """Assembles the route sidecar on rank 0 from the streams of its data-parallel group; every
    rank calls it (it holds a barrier). Returns the number of documents written on rank 0, else None.
    """
    import torch

    from megatron_ext.replay.route_recorder import record_streams
    from megatron_ext.replay.route_stream import remove_stream

    run = state(args)
    replay = run.configs[ReplayConfig]
    if replay.route_replay_mode != "record":
        return None
    _, writes, streams = record_streams(replay.route_record_path)
    recorder = _record_stream(args)  # also on a rank that recorded nothing: an empty stream
    if recorder is not None:
        recorder.close()  # flushed to disk (a named stream stays until assembled)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every stream is complete on disk
    if not writes:
        return None
    # By streaming, temporary files renamed into place, in DP rank order: a token recorded twice
    # keeps the last, as when the packs were gathered.
    written = recorder.write(replay.route_record_path, streams=streams)
    for base in streams:
        remove_stream(base)
    return written


def reset() -> None:
    """Forgets the run's state (between runs in one process, e.g. tests)."""
    global _STATE
    _STATE = None


@contextmanager
def kept() -> Iterator[None]:
    """Within the block, a state made for other arguments (a copy of the run's, say) replaces the
    run's only until the block ends: the run's state, and what it holds, is back after."""
    global _STATE
    saved = _STATE
    try:
        yield
    finally:
        _STATE = saved
