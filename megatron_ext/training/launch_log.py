"""What a ``megatron_ext.pretrain_gpt`` launch prints: a short configuration, what megatron_ext did, one
line per log interval and the result; Megatron's lines that do not apply to the run are left out
(docs/rehearse.md, "What a launch prints"). A tiny launch used to print about 960 lines, 841 of them
Megatron's argument dump; now the configuration is::

    megatron_ext: model HybridModel '*E*E': 4 layers, hidden 64, 4 heads, 8 experts top-2 (AlignedMoELayer), float32
    megatron_ext: parallel 2 ranks: data 2, tensor 1, pipeline 1, context 1, expert 2 (gloo)
    megatron_ext: data PackedDataset, sequence 768, micro-batch 2, global batch 4, 6 iterations
    megatron_ext: flags --pad-policy self --pad-to-seq-len --pack-documents ... (--cpu)
"""

import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_ext.config.megatron_view import MegatronView, field_default
from megatron_ext.config.registry import flag_value

#: Seconds a rank other than the first waits before printing its refusal: every rank checks the same
#: arguments, so the first refuses too, the launcher stops the others and the refusal prints once.
REFUSAL_GRACE_S = 10.0
#: The async-save deprecation Megatron 0.19.2 logs on every synchronous torch_dist save
#: (``TorchDistSaveShardedStrategy.save`` calls ``async_save(..., async_strategy="mcore")``).
ASYNC_SAVE_DEPRECATION = (
    "megatron.core.dist_checkpointing.strategies.torch",
    "MCore's async save is deprecated",
)


def shows_everything(argv: Sequence[str]) -> bool:
    """``--verbose``: every line Megatron prints, the argument dump included."""
    return "--verbose" in argv


def quiet_megatron_info(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Keeps Megatron's loggers at WARNING unless the user chose a level; returns whether it did."""
    # Megatron's setup_logging sets the root level from --logging-level or MEGATRON_LOGGING_LEVEL
    # and leaves it at INFO otherwise (its DDP and optimizer configs, index loads, dataset
    # builders); only that last case changes, on the "megatron" logger: megatron_ext's own loggers
    # keep the root's level.
    chosen = any(a == "--logging-level" or a.startswith("--logging-level=") for a in argv)
    if chosen or "MEGATRON_LOGGING_LEVEL" in environ or shows_everything(argv):
        return False
    logging.getLogger("megatron").setLevel(logging.WARNING)
    return True


def argument_dump_when_asked() -> Any:
    """Within the block, Megatron's ``validate_args`` prints its argument dump only for
    ``--log-arguments`` or ``--verbose`` (the ``launch`` compatibility row of ``_print_args``, which
    a training launch then keeps with the others)."""
    from megatron_ext import compat

    return compat.patched_rows([compat.row("megatron.training.arguments._print_args")])


def dump_only_when_asked(original: Any) -> Any:
    """``_print_args`` printing only for ``--log-arguments`` or ``--verbose`` (read off the
    arguments it is handed)."""

    @functools.wraps(original)
    def print_args(title: str, args: Any) -> None:
        if flag_value(args, "log_arguments") or flag_value(args, "verbose"):
            original(title, args)

    return print_args


def _run_args() -> Any:
    """The run's arguments as Megatron holds them (None before it sets them: Megatron's behaviour)."""
    from megatron.training import global_vars

    return global_vars._GLOBAL_ARGS


def _quiet(args: Any) -> bool:
    return args is not None and not flag_value(args, "verbose")


# The launch rows below drop, at Megatron's seams, lines never true of the run, reading the run's
# arguments when Megatron calls them.
def memory_report_where_it_applies(original: Any) -> Any:
    """``report_memory`` skipped without CUDA (every number 0.00) unless ``--log-memory-interval``
    asks for it or ``--verbose`` shows everything."""
    import torch

    @functools.wraps(original)
    def report_memory(*args: Any, **kwargs: Any) -> Any:
        run = _run_args()
        if _quiet(run) and run.log_memory_interval is None and not torch.cuda.is_available():
            return None
        return original(*args, **kwargs)

    return report_memory


def estimate_where_there_is_one(original: Any) -> Any:
    """``report_theoretical_memory`` skipped for a HybridModel, which it has no estimate for (it
    prints only that); GPTModel's estimate prints as before."""
    from megatron.training.utils import is_hybrid_model

    @functools.wraps(original)
    def report_theoretical_memory(args: Any, *rest: Any, **kwargs: Any) -> Any:
        if _quiet(args) and is_hybrid_model(args):
            return None
        return original(args, *rest, **kwargs)

    return report_theoretical_memory


def save_without_async_deprecation(original: Any) -> Any:
    """``TorchDistSaveShardedStrategy.save`` with the async-save deprecation left out of its log
    when the run saves synchronously (no ``--async-save``; ``--verbose`` shows it)."""
    logger = logging.getLogger(ASYNC_SAVE_DEPRECATION[0])

    @functools.wraps(original)
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = _run_args()
        if not _quiet(run) or MegatronView.from_args(run).async_save:
            return original(self, *args, **kwargs)
        drop = _DropPrefix(ASYNC_SAVE_DEPRECATION[1])
        logger.addFilter(drop)
        try:
            return original(self, *args, **kwargs)
        finally:
            logger.removeFilter(drop)

    return save


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefix)


def configuration_lines(args: Any, resolved: Mapping[str, Any]) -> list[str]:
    """The launch's configuration in four lines (model, parallelism, data, megatron_ext flags)."""
    model = resolved["model"]
    if model == "HybridModel":
        model += f" '{args.hybrid_layer_pattern}'"
    parts = [f"{args.num_layers} layers", f"hidden {args.hidden_size}"]
    parts.append(f"{args.num_attention_heads} heads")
    if args.num_experts:
        parts.append(
            f"{args.num_experts} experts top-{args.moe_router_topk} ({resolved['moe_layer']})"
        )
    dtype = str(args.params_dtype).removeprefix("torch.")
    if resolved.get("cpu_rehearsal"):
        dtype += f", {resolved['cpu_rehearsal']} rehearsed"
    parallel = resolved["parallel"]
    data = [resolved["dataset"], f"sequence {args.seq_length}"]
    data += [f"micro-batch {args.micro_batch_size}", f"global batch {args.global_batch_size}"]
    if args.train_iters:
        data.append(f"{args.train_iters} iterations")
    if resolved.get("document_multiple", 1) > 1:  # context parallelism's per-document split
        data.append(f"every document padded to a multiple of {resolved['document_multiple']}")
    flags = changed_flags(args)
    return [
        f"megatron_ext: model {model}: {', '.join(parts)}, {dtype}",
        f"megatron_ext: parallel {resolved['world_size']} ranks: data {parallel['dp']}, tensor "
        f"{parallel['tp']}, pipeline {parallel['pp']}, context {parallel['cp']}, expert "
        f"{parallel['ep']} ({args.distributed_backend})",
        f"megatron_ext: data {', '.join(data)}",
        f"megatron_ext: flags {' '.join(flags) if flags else 'none (Megatron runs as is)'}",
    ]


def changed_flags(args: Any) -> list[str]:
    """megatron_ext's flags whose value is not the default, as they would be written."""
    from megatron_ext.training.feature_configs import FEATURE_CONFIGS, flag

    out = []
    for cls in FEATURE_CONFIGS:
        for f in dataclasses.fields(cls):
            value = flag_value(args, f.name)
            if value == field_default(f) or f.name in ("verbose", "log_arguments"):
                continue
            written = flag(f.name)
            if value is not True:
                written += f" {' '.join(map(str, value)) if isinstance(value, list) else value}"
            out.append(written)
    return out


def refuse(line: str) -> int:
    """Prints ``megatron_ext: LINE`` on stderr once per launch and returns the exit status, 2."""
    # The first rank (RANK 0, or no RANK: one process) prints at once. Another waits first: the
    # first rank refuses the same arguments, and the launcher (torchrun, or rehearse's
    # local_launch) stops the other ranks when it exits; a refusal only some ranks see (a file one
    # node lacks) still prints, from each of them.
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        time.sleep(REFUSAL_GRACE_S)
        line += f" (rank {rank})"
    sys.stderr.write(f"megatron_ext: {line}\n")
    sys.stderr.flush()
    return 2
