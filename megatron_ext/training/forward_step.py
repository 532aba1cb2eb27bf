"""Forward step for ``megatron_ext.pretrain_gpt``: pad mask, document boundaries and replay routes reach
Megatron's model; expert-load metrics reach Megatron's logger and writers (docs/architecture.md,
"The path of a batch", steps 2 to 5). Example::

    output, loss_fn = forward_step(iter(loader), model)
    loss, num_tokens, report = loss_fn(output)
"""

import json
import os
from collections.abc import Hashable
from functools import partial
from typing import Any

import torch

from megatron_ext.config.megatron_view import MegatronView, TrainingProgress
from megatron_ext.config.registry import flag_value
from megatron_ext.training import policy_step, run_state
from megatron_ext.training.feature_configs import MoEAlignmentConfig
from megatron_ext.training.throughput_log import count_micro_batch, log_token_throughput


def batch_to_device(batch: dict[str, Any]) -> dict[str, Any]:
    """A host micro-batch's tensors on the current device (non-blocking copies)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {
        key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
        for key, value in batch.items()
    }


#: A local loss this many times the largest of the first 100 seen is spiky (Megatron-LM's
#: ``SPIKY_LOSS_FACTOR``, pretrain_gpt.py).
SPIKY_LOSS_FACTOR = 10


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss contract: (sum of masked per-token loss, token count, report), the local
    loss validated first as Megatron-LM's own ``pretrain_gpt.py`` does (:func:`validate_loss`)."""
    from megatron.training import get_args

    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    validate_loss(loss, run_state.state(get_args()).parsed)  # the flags, read once per run
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def validate_loss(loss: torch.Tensor, view: MegatronView) -> None:
    """Megatron's loss guards on the local loss, before the data-parallel reduction and the backward:
    NaN and Inf are fatal, a spiky loss is reported; ``--rerun-mode`` decides what follows."""
    # As Megatron-LM's pretrain_gpt.py loss_func calls them (NVIDIA/Megatron-LM d98e8a6). By
    # default the rerun state machine reruns the iteration in place, then the job checkpoints and
    # exits non-zero; --rerun-mode disabled raises at once.
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    if view.check_for_nan_in_loss_and_grad:
        # NOTE: device-to-host sync (the machine reads the rejection), Megatron's own: its flag
        # --no-check-for-nan-in-loss-and-grad turns it off.
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic
                fatal=True,
            )
    if view.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def begin_micro_batch(args: Any, model: torch.nn.Module | None = None) -> tuple[Hashable, bool]:
    """``(key, first of its step)`` for the micro-batch about to run forward on the chunk ``model``,
    begun on the run's micro-batch context (attached to ``model`` on first sight).

    Training micro-batches are keyed ``(iteration, index in the step)``; evaluation forwards get
    keys of their own and never start or end a step.
    """
    run = run_state.state(args)
    chunk = model_chunk(model)
    if model is not None:
        run.micro_batches.attach(model)
    # Megatron's evaluate runs its forwards under torch.no_grad.
    if not torch.is_grad_enabled():
        run.eval_forwards[chunk] = run.eval_forwards.get(chunk, 0) + 1
        key = ("eval", run.eval_forwards[chunk])
        run.micro_batches.begin(key, training=False)
        return key, True
    # A step boundary is the iteration changing, whatever the number of micro-batches (batch-size
    # ramp-up, evaluation in between). When a new step starts the previous one is complete (every
    # forward and backward), so its metrics are logged then.
    iteration = TrainingProgress.from_args(args).curr_iteration
    first = iteration != run.iteration
    if first:
        finished, run.iteration = run.iteration, iteration
        run.positions.clear()
        if finished is not None:
            log_token_throughput(args, finished)
            log_expert_load(args, finished)
            log_replay_check(args, finished)
    # Under virtual pipeline stages the schedule runs the forward step once per micro-batch and
    # chunk, each chunk with its own data iterator in micro-batch order: counted per chunk, a
    # micro-batch has one key on every chunk.
    key = (iteration, run.positions.get(chunk, 0))
    run.positions[chunk] = key[1] + 1
    run.micro_batches.begin(key)
    return key, first


def model_chunk(model: torch.nn.Module | None) -> int:
    """The virtual pipeline stage of the model chunk ``model`` (possibly wrapped); 0 without."""
    from megatron_ext.replay.keyed_router_replay import unwrap_model

    return 0 if model is None else (getattr(unwrap_model(model), "vp_stage", None) or 0)


def model_inputs(
    batch: dict[str, torch.Tensor], args: Any, model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """``GPTModel.forward`` keyword arguments for a batch of megatron_ext samples (this CP rank's
    share; ``model``: the chunk the forward runs, whose routers get their SP slice of the pad mask)."""
    return split_inputs(batch, args, model)[0]


def split_inputs(
    batch: dict[str, torch.Tensor], args: Any, model: torch.nn.Module | None = None
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """The model's keyword arguments, the loss mask in the model's token order, and (packed samples
    under context parallelism) the partition index of this CP rank's tokens, or None."""
    from megatron.core import parallel_state

    from megatron_ext.data.batch import (
        context_parallel_inputs,
        gpt_forward_kwargs,
        shard_padding_mask,
    )

    if parallel_state.get_context_parallel_world_size() > 1:
        # Split by Megatron's own get_batch_on_this_cp_rank: packed samples per document in THD,
        # whatever --transformer-impl (under --cpu the CP attention stand-in reads THD), others by
        # the per-sequence zigzag.
        group = parallel_state.get_context_parallel_group()
        # Under --cpu the device is the host: its empty segments go for free (no device read).
        on_host = bool(flag_value(args, "cpu"))
        kwargs, loss_mask, index = context_parallel_inputs(batch, group, drop_empty=on_host)
        return (kwargs if model is None else shard_padding_mask(kwargs, model)), loss_mask, index
    if "padding_mask" not in batch:  # Megatron's own datasets (e.g. --mock-data)
        kwargs = {
            "input_ids": batch["tokens"],
            "position_ids": batch["position_ids"],
            "attention_mask": batch.get("attention_mask"),
            "labels": batch["labels"],
        }
        return kwargs, batch["loss_mask"], None
    # Document boundaries: a per-document causal mask for the local attention, THD
    # PackedSeqParams for Transformer Engine's.
    layout = "mask" if args.transformer_impl == "local" or "cu_seqlens" not in batch else "thd"
    kwargs = gpt_forward_kwargs(batch, layout=layout)
    loss_mask = batch["loss_mask"].reshape(kwargs["input_ids"].shape)
    return (kwargs if model is None else shard_padding_mask(kwargs, model)), loss_mask, None


def layout_shape(batch: dict[str, Any], kwargs: dict[str, Any]) -> tuple[int, int]:
    """The micro-batch's ``[batch, seq]`` in the model's token order before context parallelism
    splits it: THD's ``[1, B*S]`` for packed samples, else ``[B, S]``."""
    if kwargs.get("packed_seq_params") is not None:
        return (1, batch["tokens"].numel())
    return tuple(batch["tokens"].shape)


def host_cu_seqlens(host_batch: dict[str, Any], thd: bool) -> torch.Tensor | None:
    """Under context parallelism, the packed row's segment boundaries on the host (flattened as
    the device's), from which the host repeats the device's per-document split; None otherwise."""
    from megatron.core import parallel_state

    if not thd or parallel_state.get_context_parallel_world_size() == 1:
        return None
    from megatron_ext.data.batch import flat_cu_seqlens

    cu_BC = host_batch["cu_seqlens"]
    if cu_BC.device.type != "cpu":
        raise ValueError(
            "context parallelism splits packs on the host too: the data iterator must yield CPU "
            "tensors"
        )
    cu = flat_cu_seqlens(cu_BC, host_batch["tokens"].shape[1])
    multiple = 2 * parallel_state.get_context_parallel_world_size()
    bad = cu[cu % multiple != 0]
    if bad.numel():  # on the device, Transformer Engine's kernel would only assert
        raise ValueError(
            f"a pack's document boundary ({int(bad[0])}) is not a multiple of 2 * "
            f"--context-parallel-size ({multiple}): Megatron splits packed samples per document, "
            "so every document of a pack must be padded to that multiple"
        )
    return cu


def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Megatron ``forward_step_func``: returns the per-token loss and the loss function."""
    from megatron.training import get_args

    args = get_args()
    host_batch = next(data_iterator) if data_iterator is not None else {}
    batch = batch_to_device(host_batch)
    key, starts_step = begin_micro_batch(args, model)
    training = key[0] != "eval"
    if training and model_chunk(model) == 0:  # once per micro-batch, not per virtual stage
        count_micro_batch(args, host_batch)  # host counts: tokens/s, real tokens/s, pad fraction
    kwargs, loss_mask, cp_index = split_inputs(batch, args, model)
    # The micro-batch's [batch, seq] before CP splits it: THD flattens it to one row of B*S tokens,
    # so routes are installed (and recorded) in that layout too, with the CP split's index; router
    # rows then follow the model's token order.
    model_shape = layout_shape(batch, kwargs)
    cu_host = host_cu_seqlens(host_batch, kwargs.get("packed_seq_params") is not None)
    announce_real_tokens(args, host_batch.get("padding_mask"), model_shape, starts_step, cu_host)
    if starts_step:
        # Megatron finishes every backward of a step before the next step's (or an evaluation's)
        # first forward, so the routes kept for recompute can go (every chunk's).
        for chunk_binding in run_state.state(args).replay_bindings:
            chunk_binding.clear()
    binding = run_state.replay_binding(args, model)
    if binding is not None:
        if binding.mode == "replay":
            from megatron_ext.replay.route_dataset import FILLED_KEY, has_missing_routes

            routes_BSLK, filled_BSL = batch["routes"], batch.get(FILLED_KEY)
            binding.install(
                routes_BSLK.reshape(*model_shape, *routes_BSLK.shape[2:]),
                key=key,
                # Counted by the dataset on the host: packs without a missing row skip native top-k.
                has_missing=has_missing_routes(host_batch),
                filled_BSL=None if filled_BSL is None else filled_BSL.reshape(*model_shape, -1),
                cp_index=cp_index,
            )
            check = run_state.state(args).replay_check
            if check is not None:  # counts training micro-batches only, each once
                check.count(key if training else None)
        else:
            binding.begin_record(key, *model_shape, cu_seqlens=cu_host)
    output = model(**kwargs, loss_mask=loss_mask)
    if binding is not None and binding.mode == "record" and training:
        # Only training packs: evaluation packs index another dataset (the validation split).
        # Skip mode: pads reached no expert, so what their routers computed is no route: missing.
        routing = run_state.pad_routing(args)
        pads = host_batch.get("padding_mask") if routing is not None and routing.skip else None
        run_state.record_routes(
            args, binding, key, batch["pack_index"], batch["tokens"].shape, pad_mask_BS=pads
        )
        policy_step.record_logprobs(args, output, batch, cp_index)  # --rl-record-logprobs
    # loss_func flattens both: the per-token loss ([B, S], THD's [1, B*S] or this CP rank's share)
    # and the mask share one order. (On a non-last pipeline stage ``output`` is hidden states.)
    # --rl-loss, else None: its sidecars follow the loss mask's layout (this CP rank's share).
    rl_loss = policy_step.loss_for_batch(args, batch, validate_loss, loss_mask, cp_index)
    return output, rl_loss or partial(loss_func, loss_mask)


def announce_real_tokens(
    args: Any,
    host_pad_mask: torch.Tensor | None,
    model_shape: tuple[int, int],
    starts_step: bool,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """``--moe-pad-routing skip``: tells the MoE layers how many of their router rows are real."""
    pad_routing = run_state.pad_routing(args)
    if pad_routing is None or not pad_routing.skip:
        return
    if starts_step:
        pad_routing.clear()  # every backward of the previous step has run
    if host_pad_mask is None:
        return  # no pads: the routers get no padding mask and route every token
    if host_pad_mask.device.type != "cpu":
        raise ValueError(
            "--moe-pad-routing skip counts pads on the host: the data iterator must yield CPU tensors"
        )
    from megatron.core import parallel_state

    from megatron_ext.moe.pad_routing import count_router_tokens

    # Counted on the host copy, so the dispatcher sizes its permute without reading the device:
    # the micro-batch in the model's layout, sliced for CP (per document with the host cu_seqlens,
    # as the device split; else the zigzag) and, under SP, for this TP rank.
    pad_routing.set_micro_batch(
        *count_router_tokens(
            host_pad_mask,
            model_shape,
            cp_size=parallel_state.get_context_parallel_world_size(),
            cp_rank=parallel_state.get_context_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=args.sequence_parallel,
            cu_seqlens=cu_seqlens,
        )
    )


def log_expert_load(args: Any, iteration: int) -> dict[str, Any] | None:
    """After a log iteration, reduces the load metrics and writes them to Megatron's writers.

    Counts accumulate over the ``--log-interval`` iterations since the last log (training forwards
    only); under pipeline parallelism each stage's first rank reports that stage's MoE layers.

    NOTE: device-to-host sync (inside ``ExpertLoadMetrics.summary``), only every ``--log-interval``.
    """
    metrics = run_state.load_metrics(args)
    if metrics is None or not metrics.layers or (iteration + 1) % args.log_interval:
        return None
    from megatron.core import parallel_state
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    # Summed over the ranks that together route every token once.
    summary = metrics.summary(_distinct_tokens_group(args))
    metrics.reset()
    run_state.state(args).last_load_summary = summary
    scalars = {k: v for k, v in summary.items() if isinstance(v, float)}
    worst = max((v for k, v in scalars.items() if k.endswith("rank_max_vio")), default=0.0)
    line = f"megatron_ext expert load: worst EP-rank max_vio {worst:.3f}"
    record = {
        "iteration": iteration + 1,
        **summary,
        **(run_state.state(args).last_throughput or {}),
    }
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # Each pipeline stage holds its own MoE layers, and a collective here, inside Megatron's
        # schedule, would deadlock against the stages' point-to-point waits: every stage's first
        # rank reports its own layers instead (the log gets one line per stage).
        stage = parallel_state.get_pipeline_model_parallel_rank()
        line += f" (pipeline stage {stage}, layers {', '.join(map(str, metrics.layers))})"
        record["pipeline_stage"] = stage
    if _reports_for_stage():
        print(line, flush=True)
        path = run_state.configs(args)[MoEAlignmentConfig].moe_expert_load_log
        if path:
            _append_line(path, json.dumps(record) + "\n")
    writer, wandb = get_tensorboard_writer(), get_wandb_writer()
    for name, value in scalars.items():
        if writer is not None:
            writer.add_scalar(f"expert_load/{name}", value, iteration + 1)
    if wandb is not None:
        wandb.log({f"expert_load/{k}": v for k, v in scalars.items()}, iteration + 1)
    return summary


def _distinct_tokens_group(args: Any) -> Any:
    """The ranks whose routers together see every token of the global batch once."""
    from megatron.core import parallel_state

    # Under SP each TP rank routes its slice of the sequence; without it they route the same tokens.
    if args.sequence_parallel:
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _reports_for_stage() -> bool:
    """This rank reports its pipeline stage's metrics: the stage's first rank (data-, context-
    and tensor-parallel rank 0); at PP=1 that is global rank 0, as Megatron's ``print_rank_0``."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )


def _append_line(path: str, line: str) -> None:
    """Appends one line with a single ``write`` on an ``O_APPEND`` descriptor."""
    # One write on O_APPEND: the lines of several pipeline stages never interleave within a line.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # checked at args time
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def log_replay_check(args: Any, iteration: int) -> Any:
    """After a log iteration with ``--route-replay-check``: the interval's replayed, missing and
    differing (token, layer) rows (:class:`~megatron_ext.replay.replay_check.ReplayCounts`),
    printed, problems loudly on stderr, and written as a JSON line to ``--moe-expert-load-log``.

    NOTE: device-to-host sync (``ReplayCheck.take``), only every ``--log-interval``.
    """
    check = run_state.state(args).replay_check
    if check is None or (iteration + 1) % args.log_interval:
        return None
    import sys

    from megatron.core import parallel_state

    counts = check.take(_distinct_tokens_group(args))
    stage, record = "", {"iteration": iteration + 1, "replay_check": counts.record()}
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage its own layers
        record["pipeline_stage"] = parallel_state.get_pipeline_model_parallel_rank()
        stage = f" (pipeline stage {record['pipeline_stage']})"
    if _reports_for_stage():
        print(f"megatron_ext replay check: {counts.line()}{stage}", flush=True)
        for problem in counts.problems():
            print(f"megatron_ext replay check: {problem}{stage}", file=sys.stderr, flush=True)
        path = run_state.configs(args)[MoEAlignmentConfig].moe_expert_load_log
        if path:
            _append_line(path, json.dumps(record) + "\n")
    return counts


def flush_logs(args: Any) -> None:
    """Logs the last training iteration's expert load and replay check (the loop has ended, so no
    next step starts to trigger them)."""
    run = run_state.state(args)
    if run.iteration is not None:
        log_token_throughput(args, run.iteration)
        log_expert_load(args, run.iteration)
        log_replay_check(args, run.iteration)
        run.iteration = None
