"""What ``megatron_ext.pretrain_gpt`` builds before data, built at startup so that it fails in one line.

Megatron's ``validate_args`` passes configurations its ``pretrain`` then fails on, on every rank, with a
traceback (``--moe-router-topk 1`` without ``--moe-router-pre-softmax``, a warmup not below the decay);
the dry run also builds the model on the meta device. Example::

    report = startup_checks(args)           # {"transformer_config": "TransformerConfig", ...}
    report["model"] = build_on_meta_device(args)
"""

import argparse
import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any


def one_line(err: BaseException) -> str:
    """An error as one line: its message, or for a bare ``assert`` the failing line of Megatron's
    code (file:line and source)."""
    import traceback

    message = " ".join(str(err).split())
    if message:
        return message
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__} at {frame.filename}:{frame.lineno}: {frame.line}"


@contextlib.contextmanager
def target(dry_run: bool) -> Iterator[dict[str, str]]:
    """Within the block, a dry run on a machine without Transformer Engine validates as the GPU
    target would, with a current Transformer Engine. Yields what was assumed, for the report; a
    launch (``dry_run`` False) checks as is. Restored on exit."""
    # TransformerConfig's checks of TE: is_te_min_version ("Only transformer-engine>=1.7.0
    # supports MoE FP8 training") and the fused RoPE kernel ("apply_rope_fusion is not available").
    if not dry_run or importlib.util.find_spec("transformer_engine"):
        yield {}
        return
    from megatron_ext import compat

    with compat.patched("dry_run_target"):
        yield {"transformer_engine": "not installed here: assumed current on the target"}


def current_te(original: Callable[..., bool]) -> Callable[..., bool]:
    """``TransformerConfig``'s ``is_te_min_version``: every version is there (the target's TE)."""
    del original
    return lambda *args, **kwargs: True


def on_the_target_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """Stands in for a Transformer Engine kernel during a dry run's checks; never runs."""
    del original
    return _on_the_target_only


def _on_the_target_only(*args: Any, **kwargs: Any) -> Any:
    """Stands in for a Transformer Engine kernel during a dry run's checks; never runs."""
    raise AssertionError("a dry run computes nothing")


#: What each of ``OptimizerParamScheduler.__init__``'s asserts asks of the flags.
SCHEDULE_HINTS = {
    "self.lr_warmup_steps < self.lr_decay_steps": "the warmup (--lr-warmup-iters, "
    "--lr-warmup-fraction or --lr-warmup-samples) must be below the decay (--lr-decay-iters, "
    "default --train-iters, or --lr-decay-samples)",
    "self.init_lr <= self.max_lr": "--lr-warmup-init must not exceed --lr",
    "self.max_lr >= self.min_lr": "--min-lr must not exceed --lr",
    "self.end_wd >= self.start_wd": "--end-weight-decay must not be below --start-weight-decay",
    "self.lr_decay_steps > 0": "--lr-decay-iters (default --train-iters) must be positive",
}


def startup_checks(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron's model config (its ``__post_init__`` checks), the LR schedule and the checkpoint
    to load, as the launch builds them, before any process group. Returns what was found, for the
    dry run's report.

    Raises:
        ValueError: In one line, with Megatron's message where Megatron has one.
    """
    from megatron_ext.training.checkpoint_checks import (
        check_checkpoint_files,
        check_checkpoint_model,
        check_save_directory,
        find_load_checkpoint,
    )
    from megatron_ext.training.launch_args import builds_optimizer
    from megatron_ext.training.model_provider import model_config_from_args
    from megatron_ext.training.resume_checks import build_scheduler, check_resume, megatron_args
    from megatron_ext.training.vocab_check import padded_vocab_size

    padded = padded_vocab_size(args)
    try:
        with megatron_args(args) as run_args:
            # Without the tokenizer here, a stand-in size: no check of the config reads it.
            stand_in = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
            run_args.padded_vocab_size = padded or stand_in
            model_cfg = model_config_from_args(run_args)
    except (AssertionError, ValueError) as err:
        raise ValueError(f"Megatron's TransformerConfig: {one_line(err)}") from None
    try:
        if builds_optimizer(args):  # --skip-train: Megatron builds no optimizer, no schedule
            with megatron_args(args) as run_args:
                build_scheduler(run_args)
    except AssertionError as err:
        failed = one_line(err)
        hint = next((h for check, h in SCHEDULE_HINTS.items() if check in failed), None)
        raise ValueError(
            f"Megatron's OptimizerParamScheduler refuses the LR schedule ({failed})"
            + (f": {hint}" if hint else "")
        ) from None
    check_save_directory(args)
    loading = find_load_checkpoint(args)
    found = loading.checkpoint
    saved = None
    if found is not None:  # the files whole, then the model they hold, before the resume
        check_checkpoint_files(found)
        saved = check_checkpoint_model(args, found, padded)
    report: dict[str, Any] = {
        "transformer_config": type(model_cfg.transformer).__name__,
        "vocabulary": padded or "unknown here (the tokenizer loads on the target)",
        "checkpoint": None
        if found is None
        else f"{found.flag} {found.directory}: {found.format}, iteration {found.iteration}",
        "notes": [loading.note] if loading.note else [],
    }
    if found is not None:
        report["notes"] += check_resume(args, found, saved)
    return report


def build_on_meta_device(args: argparse.Namespace) -> dict[str, Any] | str:
    """The layer spec and the model of rank 0 (and of the last rank under pipeline parallelism),
    built by megatron_ext's model provider on the meta device. Returns each built stage's class
    and parameter count, or why nothing was built here.

    Raises:
        ValueError: In one line, with Megatron's message.
    """
    import torch

    if args.transformer_impl == "transformer_engine" and not importlib.util.find_spec(
        "transformer_engine"
    ):
        return "not built here: --transformer-impl transformer_engine needs Transformer Engine"
    from megatron_ext.training.vocab_check import padded_vocab_size

    padded = padded_vocab_size(args)
    if padded is None:
        return "not built here: the vocabulary size needs the tokenizer"
    from megatron_ext.cpu.model_stack import enable_cpu_mode

    enable_cpu_mode()  # no-op with CUDA; on a CPU-only node the modules' CUDA calls are patched
    # In a process-group world of the run's size that runs no collective (PyTorch's fake backend).
    ranks = sorted({0, args.world_size - 1}) if args.pipeline_model_parallel_size > 1 else [0]
    stages: dict[str, Any] = {}
    for rank in ranks:
        try:
            with _fake_world(args, rank), torch.device("meta"):
                stages[f"rank {rank}"] = _build_stages(args, padded)
        except (AssertionError, ValueError, NotImplementedError) as err:
            raise ValueError(f"building the model (rank {rank}): {one_line(err)}") from None
    return stages


def _build_stages(args: argparse.Namespace, padded_vocab: int) -> list[str]:
    """This rank's model chunks, as Megatron's ``get_model`` builds them (one per virtual stage)."""
    from megatron.core import parallel_state as mpu

    from megatron_ext.training.model_provider import model_provider
    from megatron_ext.training.resume_checks import megatron_args

    vp_size = args.virtual_pipeline_model_parallel_size
    last_vp = (vp_size or 1) - 1
    built = []
    with megatron_args(args) as run_args:
        run_args.padded_vocab_size = padded_vocab
        run_args.init_model_with_meta_device = True  # Megatron's own switch: no device copies
        for vp in range(vp_size) if vp_size else [None]:
            first = mpu.is_pipeline_first_stage(ignore_virtual=True) and vp in (None, 0)
            last = mpu.is_pipeline_last_stage(ignore_virtual=True) and vp in (None, last_vp)
            model = model_provider(pre_process=first, post_process=last, vp_stage=vp)
            count = sum(p.numel() for p in model.parameters())
            built.append(f"{type(model).__name__} ({count} parameters)")
    return built


@contextlib.contextmanager
def _fake_world(args: argparse.Namespace, rank: int) -> Iterator[None]:
    """Megatron's process groups for ``rank`` of a world of the run's size, on PyTorch's ``fake``
    backend (no peers, no collective), torn down after."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    assert not torch.distributed.is_initialized(), "a dry run starts no process group"
    torch.distributed.init_process_group(
        "fake", store=FakeStore(), rank=rank, world_size=args.world_size
    )
    try:
        mpu.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
            create_gloo_process_groups=False,
        )
        # What Megatron's initialize does before the model: the model-parallel RNG streams that
        # weight initialisation forks (on the CPU generator under megatron_ext.cpu.model_stack).
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        yield
    finally:
        tensor_parallel.get_cuda_rng_tracker().reset()
        mpu.destroy_model_parallel()
        torch.distributed.destroy_process_group()
