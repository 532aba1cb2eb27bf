"""What a resume changes, read from the checkpoint at startup, and what Megatron 0.19.2 cannot resume.

A checkpoint holds the arguments it was saved with and its LR scheduler's state. Resuming with other
values fails late in Megatron, on every rank, with a traceback (after the model is built): a changed
``--train-iters``, ``--lr-decay-iters``, ``--global-batch-size`` or warmup trips
``OptimizerParamScheduler``'s ``assert cls_value == sd_value``; a changed
``--expert-model-parallel-size`` with ``torch_dist`` stops in the optimizer's load ("Could not find
parameter group"); with ``torch`` (one file per TP/PP/EP rank) a changed TP, PP or EP size finds no
file and stops with exit status 0 ("could not load the checkpoint"). :func:`check_resume` compares
first, refusing in one line that names the flag which makes the resume work, and returns a line
for each change Megatron does resume. The scheduler check is Megatron's own: the run's
``OptimizerParamScheduler`` (built by ``get_optimizer_param_scheduler``) loads the saved state.

Example::

    lines = check_resume(args, checkpoint)   # ["--train-iters 2 -> 4 (...)"], or ValueError
"""

import argparse
import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from megatron_ext.training.checkpoint_checks import Checkpoint, saved_state
from megatron_ext.training.launch_args import builds_optimizer

#: Flags of the LR/weight-decay schedule (argparse dest), in the order they are named.
SCHEDULE_FLAGS = (
    "train_iters", "lr_decay_iters", "global_batch_size", "lr_warmup_iters", "lr_warmup_fraction",
    "train_samples", "lr_decay_samples", "lr_warmup_samples", "lr", "min_lr", "lr_decay_style",
    "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
)  # fmt: skip
#: Parallel sizes (argparse dest) and their flags.
PARALLEL_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
    "data_parallel_size": "data-parallel size",
}


def _flag(dest: str) -> str:
    return PARALLEL_FLAGS.get(dest) or "--" + dest.replace("_", "-")


def _loads_optimizer(args: argparse.Namespace, checkpoint: Checkpoint, saved_args: Any) -> bool:
    """Whether Megatron's ``load_checkpoint`` loads the optimizer and its scheduler."""
    from megatron_ext.config.megatron_view import MegatronView

    view = MegatronView.from_args(args)
    return not (
        checkpoint.release
        or view.finetune
        or checkpoint.flag == "--pretrained-checkpoint"  # Megatron sets --finetune for it
        or view.no_load_optim
        or getattr(saved_args, "no_save_optim", False)
    )


def _changed(args: argparse.Namespace, saved_args: Any, dests: Any) -> list[str]:
    """``--flag saved -> now`` for each of ``dests`` whose value differs."""
    out = []
    for dest in dests:
        if not hasattr(saved_args, dest):
            continue
        before, now = getattr(saved_args, dest), getattr(args, dest, None)
        if dest == "expert_tensor_parallel_size":  # None means "as --tensor-model-parallel-size"
            before = before or saved_args.tensor_model_parallel_size
            now = now or args.tensor_model_parallel_size
        if before != now:
            out.append(f"{_flag(dest)} {before} -> {now}")
    return out


def check_resume(args: argparse.Namespace, checkpoint: Checkpoint) -> list[str]:
    """Compares the run with what ``checkpoint`` was saved with.

    Returns:
        One line per change Megatron resumes (empty when nothing changed, or for a format not read).

    Raises:
        ValueError: In one line, for a change Megatron would fail on, naming the flag that makes
            the resume work.
    """
    state = saved_state(checkpoint)
    saved_args = None if state is None else state.get("args")
    if saved_args is None:
        return []
    where = f"{checkpoint.flag} {checkpoint.directory} (iteration {checkpoint.iteration})"
    parallel = _changed(args, saved_args, PARALLEL_FLAGS)
    files = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size"}  # fmt: skip
    if checkpoint.format == "torch" and _changed(args, saved_args, files):
        sizes = " ".join(f"{_flag(d)} {getattr(saved_args, d)}" for d in sorted(files))
        raise ValueError(
            f"{where} is a torch-format checkpoint, one file per TP/PP/EP rank, saved with other "
            f"parallel sizes ({', '.join(_changed(args, saved_args, files))}): Megatron finds no "
            f"file for this run's ranks. Launch with {sizes}, or save in --ckpt-format torch_dist"
        )
    loads_optimizer = _loads_optimizer(args, checkpoint, saved_args)
    ep = _changed(args, saved_args, ["expert_model_parallel_size"])
    if ep and loads_optimizer and checkpoint.format == "torch_dist":
        raise ValueError(
            f"{where}: {ep[0]} cannot resume the optimizer state (Megatron 0.19.2 stops with "
            "'Could not find parameter group'); pass --no-load-optim to load the weights and "
            "the iteration and restart the optimizer (Adam moments and LR schedule)"
        )
    # --skip-train builds no optimizer (and may have no --lr): the schedule is not compared.
    refusal, effective = (
        _scheduler_refusal(args, state.get("opt_param_scheduler"))
        if builds_optimizer(args)
        else (None, args)
    )
    # As saved: Megatron's scheduler set the defaults (--lr-decay-iters from --train-iters).
    schedule = _changed(effective, saved_args, SCHEDULE_FLAGS)
    if loads_optimizer and "opt_param_scheduler" in state:
        if refusal is not None:
            raise ValueError(
                f"{where} with {', '.join(schedule) or 'another schedule'}: Megatron's "
                f"OptimizerParamScheduler refuses it ({refusal}); pass "
                "--override-opt_param-scheduler to follow this run's schedule from here, or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
    # Without the optimizer (--finetune, --no-load-optim, ...) the schedule starts afresh.
    changes = parallel + (schedule if loads_optimizer else [])
    verb = "resuming" if loads_optimizer else "loading the weights of"
    return [f"{verb} {where}: {change} (the checkpoint's -> this run's)" for change in changes]


def _scheduler_refusal(
    args: argparse.Namespace, saved: dict[str, Any] | None
) -> tuple[str | None, argparse.Namespace]:
    """Megatron's own check: this run's scheduler loads the saved state. Returns its assertion (or
    None) and the arguments as Megatron's scheduler left them (its defaults filled in)."""
    with megatron_args(args) as run_args:
        scheduler = build_scheduler(run_args)
        if saved is None:
            return None, run_args
        try:
            scheduler.load_state_dict(saved)
        except AssertionError as err:
            return " ".join(str(err).split()) or "assertion", run_args
    return None, run_args


def build_scheduler(args: argparse.Namespace) -> Any:
    """Megatron's ``get_optimizer_param_scheduler`` for ``args`` (set as Megatron's global
    arguments), over a one-parameter optimizer: the schedule's own checks run."""
    import torch
    from megatron.training.training import get_optimizer_param_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1)], lr=0.0)
    return get_optimizer_param_scheduler(optimizer)


@contextlib.contextmanager
def megatron_args(args: argparse.Namespace) -> Iterator[argparse.Namespace]:
    """Within the block, Megatron's ``get_args()`` returns a copy of ``args`` (what Megatron's code
    sets on it stays there); the previous global arguments, and the run's state (which the copy's
    would replace: it is kept per arguments object), are restored after."""
    from megatron.training import global_vars

    from megatron_ext.training import run_state

    previous = global_vars._GLOBAL_ARGS
    run_args = copy.copy(args)
    global_vars._GLOBAL_ARGS = run_args
    try:
        with run_state.kept():
            yield run_args
    finally:
        global_vars._GLOBAL_ARGS = previous
