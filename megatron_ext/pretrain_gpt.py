"""Pretrain / SFT / RL-style training of MoE GPT or Hybrid models with megatron_ext, on megatron.training.

Megatron-LM's ``pretrain_gpt.py`` with megatron_ext's flags, model provider, datasets provider and
forward step::

    torchrun --nproc-per-node 8 -m megatron_ext.pretrain_gpt <Megatron flags> <megatron_ext flags>
    python -m megatron_ext.pretrain_gpt <flags> --dry-run     # validate and print, no GPU needed
"""

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_ext.common.quiet import quiet_warnings
from megatron_ext.training.arguments import add_megatron_ext_args

#: What ``--cpu`` implies, put before the user's flags: gloo, and the unfused local equivalents of
#: Megatron's fused GPU kernels (same math; the fused ones need CUDA, Apex or Transformer Engine).
CPU_IMPLIED_FLAGS: tuple[str, ...] = (
    "--distributed-backend", "gloo", "--no-one-logger",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
    "--no-persist-layer-norm", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
)  # fmt: skip


def parse_arguments(dry_run: bool, cpu: bool = False) -> argparse.Namespace:
    """Megatron's ``parse_args`` + ``validate_args`` with megatron_ext's flags.

    A dry run skips ``set_global_variables`` (tokenizer files, writers); a dry run without CUDA and
    ``--cpu`` validate against the target GPU's compute capability.
    """
    from megatron.training.arguments import parse_and_validate_args, parse_args, validate_args

    from megatron_ext.cpu.model_stack import assume_device_capability
    from megatron_ext.training.launch_log import argument_dump_when_asked

    # Before the user's flags, so an explicit --distributed-backend nccl wins here and is refused
    # later, naming the flag.
    if cpu:
        sys.argv[1:1] = list(CPU_IMPLIED_FLAGS)
    rehearsal = _fp4_rehearsal_validation() if cpu else contextlib.nullcontext()
    # Megatron 0.19.2's pretrain takes a config container, not extra_args_provider: the arguments
    # are parsed here and the container is built in train(), as the wheel's own entry points do.
    if not dry_run:
        with assume_device_capability() if cpu else contextlib.nullcontext(), rehearsal:
            with argument_dump_when_asked():
                return parse_and_validate_args(extra_args_provider=_one_line_parser_errors)
    args = parse_args(extra_args_provider=_one_line_parser_errors)
    with assume_device_capability(), rehearsal, argument_dump_when_asked():
        validate_args(args)
    return args


def _one_line_parser_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron_ext's flags, and a parser error raised as ``ValueError`` (one line, exit 2 in
    :func:`main`) instead of argparse's usage of every flag (about 1,300 lines) on every rank."""
    add_megatron_ext_args(parser)

    def error(message: str) -> None:
        raise ValueError(f"{message} (--help lists every flag)")

    parser.error = error  # type: ignore[method-assign]
    return parser


def _fp4_rehearsal_validation() -> Any:
    """Under ``--cpu``, a block within which Megatron's NVFP4 check of Transformer Engine (2.7.0.dev0)
    passes; every other version check asks TE as before."""
    # A rehearsal never runs the NVFP4 kernels: the model is built unquantized and only the expert
    # groups are aligned and checked (megatron_ext.training.cpu_rehearsal).
    from megatron_ext import compat

    return compat.patched("fp4_rehearsal")


def passing_nvfp4_te_check(original: Callable[..., bool]) -> Callable[..., bool]:
    """``is_te_min_version`` answering True for the NVFP4 kernels' 2.7.0.dev0 only."""

    def te_min_version(version: str, *rest: Any, **kw: Any) -> bool:
        return True if version == "2.7.0.dev0" else original(version, *rest, **kw)

    return te_min_version


def resolved_configuration(args: argparse.Namespace) -> dict[str, Any]:
    """What megatron_ext will do for these arguments, after every check has passed."""
    from megatron.training.utils import is_hybrid_model

    from megatron_ext.moe.config import align_size_for_config
    from megatron_ext.training import run_state
    from megatron_ext.training.dataset_provider import (
        doc_pad_multiple_from_args,
        pad_multiple_from_args,
    )
    from megatron_ext.training.feature_configs import (
        MoEAlignmentConfig,
        MoEPadRoutingConfig,
        PaddingConfig,
    )

    cfgs = run_state.configs(args)  # raises ValueError naming the flag on any bad value/combination
    alignment, padding = cfgs[MoEAlignmentConfig], cfgs[PaddingConfig]
    pad_routing, why = (
        cfgs[MoEPadRoutingConfig].resolve(args) if args.num_experts else ("none", "dense model")
    )
    return {
        "model": "HybridModel" if is_hybrid_model(args) else "GPTModel",
        "moe_layer": _moe_layer(args, alignment, pad_routing),
        "moe_pad_routing": f"{pad_routing} ({why})",
        # The dispatcher's own rule (256 under the op fuser), read off the same attribute names.
        "expert_group_alignment": align_size_for_config(args, alignment),
        "dataset": _dataset_class(args, cfgs),
        "pack_length": f"multiple of {pad_multiple_from_args(args)}"
        if padding.pack_documents and not padding.pad_to_seq_len
        else args.seq_length,
        # Under CP every packed document is padded to a multiple of 2*CP (its own tokens).
        "document_multiple": doc_pad_multiple_from_args(args)
        if padding.pack_documents or args.sft
        else 1,
        "world_size": args.world_size,
        "parallel": {
            "tp": args.tensor_model_parallel_size,
            "pp": args.pipeline_model_parallel_size,
            "cp": args.context_parallel_size,
            "ep": args.expert_model_parallel_size,
            "dp": args.data_parallel_size,
        },
        "megatron_ext": {
            cls.__name__: {k: v for k, v in vars(cfg).items()} for cls, cfg in cfgs.items()
        },
    }


def _moe_layer(args: argparse.Namespace, alignment: Any, pad_routing: str) -> str:
    """The MoE layer class the model provider builds (``dense`` without experts)."""
    from megatron_ext.training.model_provider import uses_aligned_moe

    if not args.num_experts:
        return "dense"
    return "AlignedMoELayer" if uses_aligned_moe(alignment, pad_routing == "skip") else "MoELayer"


def _dataset_class(args: argparse.Namespace, cfgs: dict[type, Any]) -> str:
    """The dataset class the datasets provider builds (the order of data/provider.py's choice)."""
    from megatron_ext.training.feature_configs import PaddingConfig, ReplayConfig

    if args.sft:
        return "SelfPaddedSFTDataset"
    if cfgs[ReplayConfig].route_replay_mode == "replay":
        return "RoutedPackedDataset"
    if cfgs[PaddingConfig].pack_documents:
        return "PackedDataset"
    return "MockGPTDataset" if args.mock_data else "SelfPaddedGPTDataset"


def main() -> int:
    """Entry point (``python -m megatron_ext.pretrain_gpt``): the startup check, the arguments
    validated once, then the dry run's report or Megatron's training loop. A refusal is one line,
    exit 2."""
    argv = sys.argv[1:]
    dry_run, cpu = "--dry-run" in argv, "--cpu" in argv
    from megatron_ext.training.launch_log import configuration_lines, refuse

    untested = _start(argv, cpu, dry_run)
    if untested:
        print(untested, file=sys.stderr)
        return 2
    from megatron_ext.training.dry_run import one_line

    try:
        args = parse_arguments(dry_run, cpu)
    except (AssertionError, ValueError) as err:  # Megatron's validate_args asserts and raises
        if "--verbose" in argv:
            raise
        return refuse(f"invalid arguments: {one_line(err)}")
    try:
        resolved = _validated(args, cpu, dry_run)
    except ValueError as err:
        return refuse(f"invalid arguments: {err}")
    if not dry_run and os.environ.get("RANK", "0") == "0":
        for line in configuration_lines(args, resolved):
            print(line, flush=True)
        if args.num_experts:
            print(f"megatron_ext: --moe-pad-routing {resolved['moe_pad_routing']}", flush=True)
        for note in resolved["notes"]:  # auto-resume from an empty --save, a resume's changes
            print(f"megatron_ext: {note}", flush=True)
    if dry_run:
        print("megatron_ext resolved configuration:")
        print(json.dumps(resolved, indent=2, default=str))
        print("megatron_ext: dry run OK, exiting without training")
        return 0
    return train(args)


def _start(argv: list[str], cpu: bool, dry_run: bool) -> str | None:
    """What runs before Megatron parses anything: quiet imports, the ``--cpu`` preparation and the
    startup check. Returns the check's refusal (None: go on; ``--allow-untested-megatron`` too)."""
    from megatron_ext.training.launch_log import quiet_megatron_info

    if "--verbose" not in argv:
        quiet_warnings()
    quiet_megatron_info(argv, os.environ)  # before Megatron's import: it logs at import time
    if cpu:
        from megatron_ext.training.startup import prepare_cpu_launch

        # Before Megatron's import: it compiles at import (the flag is read before parsing too).
        caching = not {"--no-cpu-caching-malloc", "--disable-cpu-caching-malloc"} & set(argv)
        prepared = prepare_cpu_launch(caching)
        if os.environ.get("RANK", "0") == "0":
            print(prepared, flush=True)
    from megatron_ext.compat.check import check_megatron, launch_groups

    # Before anything is patched: Megatron's own sources are hashed, for the rows this launch applies.
    untested = check_megatron(groups=launch_groups(cpu=cpu, dry_run=dry_run))
    if untested and "--allow-untested-megatron" not in argv:
        return untested
    if cpu:
        from megatron_ext.cpu.training_loop import enable_cpu_training

        enable_cpu_training()
        # validate_args asserts it under TP/CP (a CUDA stream setting; nothing to tune on CPU).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return None


def _validated(args: argparse.Namespace, cpu: bool, dry_run: bool) -> dict[str, Any]:
    """Every check of the launch, once (the providers reuse its configs), and what the launch
    builds before data (Megatron's model config, LR schedule, checkpoint; the model itself on the
    meta device in a dry run). Returns the resolved configuration.

    Raises:
        ValueError: The one line a refusal prints.
    """
    from megatron_ext.training.dry_run import build_on_meta_device, startup_checks, target
    from megatron_ext.training.launch_rules import validate

    validate(args, launch=True)
    resolved = resolved_configuration(args)
    if cpu:
        _announce_rehearsal(args, resolved)
    with target(dry_run and not cpu) as assumed:
        resolved.update(startup_checks(args), **assumed)
        if dry_run:
            resolved["built_on_meta_device"] = build_on_meta_device(args)
    return resolved


def _announce_rehearsal(args: argparse.Namespace, resolved: dict[str, Any]) -> None:
    """Under ``--cpu``, a quantized run's rehearsal: taken off Megatron's arguments (the model
    computes unquantized), kept on the run's state, reported."""
    from megatron_ext.training import run_state
    from megatron_ext.training.cpu_rehearsal import describe, take_quantization

    precision = take_quantization(args)
    run_state.state(args).rehearsal = precision
    if precision is None:
        return
    resolved["cpu_rehearsal"] = describe(precision)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"megatron_ext: --cpu rehearsal of {describe(precision)}: the model computes "
            f"unquantized; expert groups are aligned to {resolved['expert_group_alignment']} "
            "and checked by the grouped-GEMM backend as the quantized kernels would",
            flush=True,
        )


def train(args: argparse.Namespace) -> int:
    """Runs Megatron's training loop with megatron_ext's providers (CUDA, or CPU under ``--cpu``)."""
    from megatron_ext.training.dataset_provider import DataRefusedError
    from megatron_ext.training.dry_run import one_line
    from megatron_ext.training.launch_log import refuse

    try:
        _pretrain(args)
    except DataRefusedError as err:  # bad data only the built datasets show: one line, exit 2
        if "--verbose" in sys.argv:
            raise
        status = refuse(f"invalid data: {one_line(err)}")
        destroy_process_groups()
        return status
    _finish(args)
    destroy_process_groups()
    return 0


def _pretrain(args: argparse.Namespace) -> None:
    """``megatron.training.pretrain`` with megatron_ext's providers and the ``launch`` rows."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_ext import compat
    from megatron_ext.training.dataset_provider import train_valid_test_datasets_provider
    from megatron_ext.training.forward_step import forward_step
    from megatron_ext.training.model_provider import model_provider

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if args.cpu:
        from megatron_ext.training.startup import fork_checkpoint_results_queue

        fork_checkpoint_results_queue(args)  # before any process group (startup.py says why)
    # The loss log's reset, no make for prebuilt helpers, a failed load exits 1, and the lines
    # that do not apply to the run left out (megatron_ext.training.launch_log).
    compat.apply("launch")
    cfg = pretrain_cfg_container_from_args(args)
    # By keyword: 0.18.2 takes model_provider second, 0.19.2 after forward_step_func.
    pretrain(
        cfg,
        train_valid_test_dataset_provider=train_valid_test_datasets_provider,
        model_provider=model_provider,
        model_type=ModelType.encoder_or_decoder,
        forward_step_func=forward_step,
    )


def _finish(args: argparse.Namespace) -> None:
    """After the loop: the last log lines, the rehearsal's summary and what record modes wrote."""
    import torch

    from megatron_ext.training import run_state
    from megatron_ext.training.forward_step import flush_logs

    flush_logs(args)
    log = run_state.state(args).rehearsal_log
    if log is not None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # One write, newline included: ranks share the launcher's stdout, and print's separate
        # write of the newline let another rank's line land in between (seen in CI).
        sys.stdout.write(f"megatron_ext: rank {rank} rehearsal: {log.summary()}\n")
        sys.stdout.flush()
    written = run_state.finish_recording(args)
    if written is not None:
        print(f"megatron_ext: wrote recorded routes of {written} documents")
    from megatron_ext.training.policy_step import finish_logprobs

    written = finish_logprobs(args)  # --rl-record-logprobs
    if written is not None:
        print(f"megatron_ext: wrote recorded log-probs of {written} documents")


def destroy_process_groups() -> None:
    """Destroys every process group while the interpreter is still whole (Megatron's loop leaves
    them to interpreter exit)."""
    # Left to exit, a gloo group's C++ worker threads can still hold work items whose tensors
    # reference Python objects; freeing them during finalization aborts the process ("terminate
    # called without an active exception", SIGABRT after training finished: seen once in this
    # project's CI, and described in pytorch/pytorch#179291 and #190489). With NCCL it is what
    # PyTorch asks for at exit. Local to each rank: every collective has completed by now.
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from megatron_ext.common.process_exit import die_with_the_agent

    die_with_the_agent()  # first: a rank under torchrun ends with its agent (a kill -9 included)
    status = main()
    if "--cpu" in sys.argv[1:]:
        # A rehearsal rank skips the interpreter's teardown of torch and Megatron (about 2 s of a
        # 13 s tiny launch here, benchmarked in megatron_ext.bench.launch); threads, atexit
        # handlers and the streams are finished as the interpreter would.
        from megatron_ext.common.process_exit import exit_like_the_interpreter

        exit_like_the_interpreter(status)
    sys.exit(status)
