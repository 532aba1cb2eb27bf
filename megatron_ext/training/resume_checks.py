"""What a resume changes, read from the checkpoint at startup, and what Megatron 0.19.2 cannot resume.

Resuming with other values than the checkpoint's fails late in Megatron, on every rank, with a
traceback after the model is built (or with exit status 0); this refuses those first, in one line
naming the flag that makes the resume work, and prints a line for each change Megatron does resume
(docs/limits.md, "Checkpoint and resume"). Example::

    lines = check_resume(args, checkpoint)   # ["--train-iters 2 -> 4 (...)"], or ValueError
"""

import argparse
import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import flag
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
#: Flags Megatron's optimizer builds its param groups' ``max_lr``/``min_lr`` from.
LR_FLAGS = ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr")
#: The schedule flags whose values a resume with --use-checkpoint-opt_param-scheduler takes from
#: the checkpoint's scheduler instead (the iterations and the batch are still this run's).
SCHEDULER_HELD = frozenset(SCHEDULE_FLAGS) - {"train_iters", "train_samples", "global_batch_size"}
#: The groups of Megatron's parser (and every megatron_ext feature group but the entry's) whose
#: flags say what is trained: the model and its routing, the data and its sample order.
DATA_MODEL_GROUPS = (
    "transformer configuration", "network size", "moe", "mla", "experimental_attention_variant",
    "heterogeneous architecture", "regularization", "RNG and initialization",
    "data and dataloader", "tokenizer", "sft",
)  # fmt: skip
#: Recorded arguments no resume line names: set by Megatron after startup or from other flags
#: (compared through those), where files go, what is logged, how the data loads; the parallel
#: sizes and schedule (above); the model's shape (layers, hidden size, experts, vocabulary:
#: checkpoint_checks refuses a model the checkpoint's weights do not fit).
NOT_NAMED = frozenset({
    "encoder_seq_length", "decoder_seq_length", "num_query_groups", "kv_channels",
    "padded_vocab_size", "num_workers", "data_cache_path", "dataloader_fast_cache_load",
    "dataloader_defer_npy_index_mmap", "mmap_bin_files", "num_dataset_builder_threads",
    "object_storage_cache_path", "config_logger_dir", "init_model_with_meta_device",
    "use_cpu_initialization", "perform_initialization", "moe_per_layer_logging",
    "route_record_path", "moe_expert_load_metrics", "moe_expert_load_log", "route_replay_check",
    "weight_decay", "num_layers", "hidden_size", "num_experts", "vocab_size",
    *SCHEDULE_FLAGS, *PARALLEL_FLAGS,
})  # fmt: skip
#: Flags the sample order depends on (Megatron's GPTDataset index, the pack plan): a resume
#: continues at the checkpoint's consumed-samples count in this run's order.
SAMPLE_ORDER_FLAGS = frozenset({
    "seq_length", "seed", "split", "data_path", "train_data_path", "valid_data_path",
    "test_data_path", "data_args_path", "per_split_data_args_path", "mock_data", "pack_documents",
    "packing_algorithm", "packing_window", "pack_overlong_policy", "sft", "sft_packing",
    "sft_tokenizer_prompt_format",
})  # fmt: skip
#: Hyperparameters a loaded optimizer keeps from the checkpoint's param groups (torch's
#: ``Optimizer.load_state_dict`` takes the saved groups' values).
OPTIMIZER_HELD = frozenset({"adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum"})


def _flag(dest: str) -> str:
    return PARALLEL_FLAGS.get(dest) or flag(dest)


def _loads_optimizer(view: MegatronView, checkpoint: Checkpoint, saved_args: Any) -> bool:
    """Whether Megatron's ``load_checkpoint`` loads the optimizer and its scheduler."""
    return not (
        checkpoint.release
        or view.finetune
        or checkpoint.flag == "--pretrained-checkpoint"  # Megatron sets --finetune for it
        or view.no_load_optim
        or getattr(saved_args, "no_save_optim", False)
    )


def _now(args: argparse.Namespace, dest: str) -> Any:
    """This run's value of any ``dest`` the checkpoint saved (compared dest by dest, so not a
    :class:`MegatronView` field; None where this run's arguments lack it)."""
    return getattr(args, dest, None)


def _changed(args: argparse.Namespace, saved_args: Any, dests: Any) -> list[str]:
    """``--flag saved -> now`` for each of ``dests`` whose value differs."""
    out = []
    for dest in dests:
        if not hasattr(saved_args, dest):
            continue
        before, now = getattr(saved_args, dest), _now(args, dest)
        if dest == "expert_tensor_parallel_size":  # None means "as --tensor-model-parallel-size"
            before = before or saved_args.tensor_model_parallel_size
            now = now or args.tensor_model_parallel_size
        if before != now:
            out.append(f"{_flag(dest)} {before} -> {now}")
    return out


def check_resume(
    args: argparse.Namespace, checkpoint: Checkpoint, state: dict[str, Any] | None = None
) -> list[str]:
    """Compares the run with what ``checkpoint`` was saved with (``state``: its saved state as
    :func:`~megatron_ext.training.checkpoint_checks.saved_state` read it; None: read here): the
    parallel sizes, the schedule and every data and model flag the checkpoint recorded.

    Returns:
        One line per change Megatron resumes (empty when nothing changed, or for a format not read).

    Raises:
        ValueError: In one line, for a change Megatron would fail on, naming the flag that makes
            the resume work.
    """
    state = saved_state(checkpoint) if state is None else state
    saved_args = None if state is None else state.get("args")
    if saved_args is None:
        return []
    where = f"{checkpoint.flag} {checkpoint.directory} (iteration {checkpoint.iteration})"
    parallel = _changed(args, saved_args, PARALLEL_FLAGS)
    view = MegatronView.from_args(args)
    loads_optimizer = _loads_optimizer(view, checkpoint, saved_args)
    _check_parallel_change(args, saved_args, checkpoint, where, loads_optimizer)
    check_lr_change(args, saved_args, where, loads_optimizer)
    # A changed --train-iters, --lr-decay-iters, --global-batch-size or warmup trips
    # OptimizerParamScheduler's `assert cls_value == sd_value`: the check is Megatron's own, this
    # run's scheduler loading the saved state. --skip-train builds no optimizer (and may have no
    # --lr): the schedule is not compared.
    refusal, effective = (
        _scheduler_refusal(args, state.get("opt_param_scheduler"))
        if builds_optimizer(args)
        else (None, args)
    )
    # As saved: Megatron's scheduler set the defaults (--lr-decay-iters from --train-iters).
    schedule_changes = _changes(effective, saved_args, SCHEDULE_FLAGS)
    schedule = [change for _, change in schedule_changes]
    if loads_optimizer and "opt_param_scheduler" in state:
        if refusal is not None:
            raise ValueError(
                f"{where} with {', '.join(schedule) or 'another schedule'}: Megatron's "
                f"OptimizerParamScheduler refuses it ({refusal}); pass "
                "--override-opt_param-scheduler to follow this run's schedule from here, or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
    verb = "resuming" if loads_optimizer else "loading the weights of"
    lines = [f"{verb} {where}: {change} (the checkpoint's -> this run's)" for change in parallel]
    # Without the optimizer (--finetune, --no-load-optim, ...) the schedule starts afresh.
    kept = loads_optimizer and view.use_checkpoint_opt_param_scheduler
    for dest, change in schedule_changes if loads_optimizer else []:
        held = kept and dest in SCHEDULER_HELD
        why = ("not applied: --use-checkpoint-opt_param-scheduler keeps the checkpoint's"
               if held else "the checkpoint's -> this run's")  # fmt: skip
        lines.append(f"{verb} {where}: {change} ({why})")
    # --finetune (and a release or --pretrained-checkpoint) starts at iteration 0: no samples
    # were consumed.
    restarts = checkpoint.release or checkpoint.flag == "--pretrained-checkpoint" or view.finetune
    consumed = None if restarts else getattr(saved_args, "consumed_train_samples", 0)
    changes = flag_changes(args, saved_args, consumed, loads_optimizer)
    return lines + [f"{verb} {where}: {line}" for line in changes]


def _check_parallel_change(
    args: argparse.Namespace,
    saved_args: Any,
    checkpoint: Checkpoint,
    where: str,
    loads_optimizer: bool,
) -> None:
    """Refuses the parallel-size changes Megatron cannot load: a torch-format checkpoint (one
    file per TP/PP/EP rank) under other sizes, and a torch_dist optimizer state under another EP."""
    # torch: Megatron finds no file and stops with exit status 0 ("could not load the checkpoint").
    files = {"tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size"}  # fmt: skip
    if checkpoint.format == "torch" and _changed(args, saved_args, files):
        sizes = " ".join(f"{_flag(d)} {getattr(saved_args, d)}" for d in sorted(files))
        raise ValueError(
            f"{where} is a torch-format checkpoint, one file per TP/PP/EP rank, saved with other "
            f"parallel sizes ({', '.join(_changed(args, saved_args, files))}): Megatron finds no "
            f"file for this run's ranks. Launch with {sizes}, or save in --ckpt-format torch_dist"
        )
    ep = _changed(args, saved_args, ["expert_model_parallel_size"])
    if ep and loads_optimizer and checkpoint.format == "torch_dist":
        raise ValueError(
            f"{where}: {ep[0]} cannot resume the optimizer state (Megatron 0.19.2 stops with "
            "'Could not find parameter group'); pass --no-load-optim to load the weights and "
            "the iteration and restart the optimizer (Adam moments and LR schedule)"
        )


def check_lr_change(
    args: argparse.Namespace, saved_args: Any, where: str, loads_optimizer: bool
) -> None:
    """Refuses an LR change whose optimizer state :func:`matching_groups_across_lr` cannot pair:
    the distributed optimizer matches the saved groups itself (0.19.2: by ``max_lr`` too; 0.18.2:
    without, keeping the checkpoint's LR in them), MuP's groups may differ by their LR alone, and
    a --decoupled-lr set or unset adds or removes groups."""
    lr = _changed(args, saved_args, LR_FLAGS)
    if not (lr and loads_optimizer):
        return
    decoupled = [d for d in ("decoupled_lr", "decoupled_min_lr") if hasattr(saved_args, d)
                 and (getattr(saved_args, d) is None) != (_now(args, d) is None)]  # fmt: skip
    view = MegatronView.from_args(args)
    keyed_by_lr = groups_keyed_by_lr()
    not_found = "'Could not find parameter group'"
    why = (
        f"Megatron 0.19.2's distributed optimizer matches the saved param groups by their LR: "
        f"{not_found}"
        if view.use_distributed_optimizer and keyed_by_lr
        # 0.18.2 pairs them without it, and keeps the checkpoint's LR in them.
        else "Megatron 0.18.2's distributed optimizer keeps the checkpoint's LR in the param "
        "groups it loads: this run's would not apply"
        if view.use_distributed_optimizer and not view.use_checkpoint_opt_param_scheduler
        else f"under --use-mup the param groups may differ by their LR alone: {not_found}"
        if view.use_mup
        else f"{_flag(decoupled[0])} adds or removes param groups: {not_found}"
        if decoupled
        else None
    )
    if why is None:
        return
    saved = " ".join(f"{_flag(d)} {getattr(saved_args, d)}" for d in LR_FLAGS
                     if hasattr(saved_args, d) and getattr(saved_args, d) is not None)  # fmt: skip
    raise ValueError(
        f"{where}: {', '.join(lr)} cannot resume the optimizer state ({why}); launch with the "
        f"checkpoint's {saved}, or pass --no-load-optim to "
        "load the weights and the iteration and restart the optimizer (Adam moments and LR "
        "schedule)"
    )


def groups_keyed_by_lr() -> bool:
    """Whether Megatron keys saved optimizer param groups by their LR (0.19.2's
    ``param_group_identifier_keys`` hold ``max_lr``; 0.18.2's do not)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return "max_lr" in param_group_identifier_keys


def flag_changes(
    args: argparse.Namespace, saved_args: Any, consumed: int | None, loads_optimizer: bool
) -> list[str]:
    """``--flag saved -> now (...)`` for each data or model flag (:data:`DATA_MODEL_GROUPS` and
    megatron_ext's features) the checkpoint recorded with another value, in parser order.
    ``consumed``: the samples the run continues after (None: it starts at iteration 0)."""
    differing = {
        dest
        for dest, before in vars(saved_args).items()
        if dest not in NOT_NAMED and hasattr(args, dest) and _now(args, dest) != before
    }
    if not differing:  # the usual resume: no parser built (0.4 s)
        return []
    lines = []
    for dest in _data_model_dests():
        if dest not in differing:
            continue
        differing.discard(dest)  # a dest some groups list twice
        change = f"{_flag(dest)} {getattr(saved_args, dest)} -> {_now(args, dest)}"
        if dest in OPTIMIZER_HELD and loads_optimizer:
            why = "not applied: the loaded optimizer keeps the checkpoint's; --no-load-optim "
            why += "restarts it with this run's"
        elif dest in SAMPLE_ORDER_FLAGS and consumed is not None:
            why = (f"the checkpoint's -> this run's; the samples continue after the "
                   f"{consumed} consumed in this run's sample order, not the checkpoint's")  # fmt: skip
        else:
            why = "the checkpoint's -> this run's"
        lines.append(f"{change} ({why})")
    return lines


def _data_model_dests() -> list[str]:
    """The dests of :data:`DATA_MODEL_GROUPS` and megatron_ext's feature groups, in parser order."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_ext.training.arguments import add_megatron_ext_args

    parser = add_megatron_ext_args(add_megatron_arguments(argparse.ArgumentParser(add_help=False)))
    return [
        action.dest
        for group in parser._action_groups
        if group.title in DATA_MODEL_GROUPS
        or (group.title or "").startswith("megatron_ext: ")
        and not group.title.startswith("megatron_ext: entry")
        for action in group._group_actions
    ]


def _changes(args: argparse.Namespace, saved_args: Any, dests: Any) -> list[tuple[str, str]]:
    """``(dest, "--flag saved -> now")`` for each of ``dests`` whose value differs."""
    return [(d, c) for d in dests for c in _changed(args, saved_args, [d])]


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


def matching_groups_across_lr(original: Any) -> staticmethod:
    """``MegatronOptimizer._filter_and_reorder_param_groups`` that also pairs the saved param groups
    with this run's after an LR change (a ``launch`` row of the compatibility table).

    A matched group takes this run's ``max_lr``/``min_lr`` unless
    --use-checkpoint-opt_param-scheduler keeps the checkpoint's. Which saved state goes to which
    parameter is Megatron's as before.
    """
    # Megatron 0.19.2 keys a group by its hyperparameters (param_group_identifier_keys), max_lr
    # and min_lr included: this run's --lr/--min-lr (--decoupled-lr/--decoupled-min-lr for the
    # embedding's group), so a new LR found no saved group ("Could not find parameter group"),
    # whichever scheduler flag. 0.18.2 keys them without the LR and pairs them itself, but the
    # groups kept the checkpoint's LR, so the scheduler (which reads it from the groups) ignored
    # a new --lr even with --override-opt_param-scheduler.
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    lr_keys = ("max_lr", "min_lr")

    def identifier(group: dict, leave_out: tuple[str, ...] = ()) -> tuple:
        # As Megatron's: a NeMo "pre_" alias stands for the key; missing and None are alike.
        return tuple(
            group[key] if key in group else group.get(f"pre_{key}")
            for key in param_group_identifier_keys
            if key not in leave_out
        )

    def with_run_lr(groups: list[dict], current_groups: list[dict]) -> list[dict]:
        """``groups`` (paired with ``current_groups``, in order) with this run's LR, unless
        --use-checkpoint-opt_param-scheduler keeps the checkpoint's."""
        from megatron.training import global_vars

        if not getattr(global_vars._GLOBAL_ARGS, "use_checkpoint_opt_param_scheduler", False):
            for group, current in zip(groups, current_groups, strict=True):
                group.update({k: current[k] for k in lr_keys if k in current})
        return groups

    def filter_and_reorder(current_groups: list[dict], state_dict_groups: list[dict]) -> list[dict]:
        saved_keys = {identifier(g) for g in state_dict_groups}
        if all(identifier(g) in saved_keys for g in current_groups):
            # 0.19.2 (LR in the key): the same LR already; 0.18.2: the checkpoint's LR until here.
            return with_run_lr(original(current_groups, state_dict_groups), current_groups)
        # Matched by the other keys instead, where that pairing is one to one.
        needed = [identifier(g, lr_keys) for g in current_groups]
        saved = {identifier(g, lr_keys): g for g in state_dict_groups}
        if not (len(set(needed)) == len(needed) == len(saved) == len(state_dict_groups)
                and set(needed) == set(saved)):  # fmt: skip
            return original(current_groups, state_dict_groups)  # Megatron's error
        final = []
        params_in_saved_order = [g["params"] for g in state_dict_groups]
        for key, params in zip(needed, params_in_saved_order, strict=True):
            group = saved[key]
            group["params"] = params  # as Megatron's: the saved order of the state stays
            final.append(group)
        return with_run_lr(final, current_groups)

    return staticmethod(filter_and_reorder)


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
