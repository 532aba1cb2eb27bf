"""What a ``megatron_ext.pretrain_gpt`` launch prints: a short configuration, what megatron_ext did, one
line per log interval and the result; Megatron's lines that do not apply to the run are left out.

A tiny launch used to print about 960 lines, 841 of them Megatron's argument dump. By default now:

- the argument dump (``validate_args`` -> ``_print_args``) prints only with ``--log-arguments`` (or
  ``--verbose``); :func:`configuration_lines` gives the few lines that matter instead::

      megatron_ext: model HybridModel '*E*E': 4 layers, hidden 64, 4 heads, 8 experts top-2 (AlignedMoELayer), float32
      megatron_ext: parallel 2 ranks: data 2, tensor 1, pipeline 1, expert 2 (gloo)
      megatron_ext: data PackedDataset, sequence 768, micro-batch 2, global batch 4, 6 iterations
      megatron_ext: flags --pad-policy self --pad-to-seq-len --pack-documents ... (--cpu)

- Megatron's INFO logs (configs of its DDP and optimizer, index loads, dataset builders) stay at
  WARNING unless ``--logging-level`` or ``MEGATRON_LOGGING_LEVEL`` chooses a level (Megatron's own
  knobs) or ``--verbose`` is given; megatron_ext's own loggers are untouched;
- :func:`install` drops, at Megatron's seams, three lines that are never true of the run: the memory
  report on a machine without CUDA (every number 0.00) unless ``--log-memory-interval`` asks for it,
  "Theoretical memory footprints not yet supported" for a HybridModel (the estimate it does have,
  for GPTModel, still prints), and the deprecation of MCore's async save on a synchronous save.

A refusal (bad flag, bad combination, bad data) is one line on the first rank (:func:`refuse`); the
launcher turns torchrun's failure report into that rank's exit status (:mod:`megatron_ext.launcher`).
"""

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: Seconds a rank other than the first waits before printing its refusal: every rank checks the same
#: arguments, so the first refuses too, the launcher stops the others and the refusal prints once.
REFUSAL_GRACE_S = 10.0
#: The async-save deprecation Megatron 0.19.2 logs on every synchronous torch_dist save
#: (``TorchDistSaveShardedStrategy.save`` calls ``async_save(..., async_strategy="mcore")``).
ASYNC_SAVE_DEPRECATION = (
    "megatron.core.dist_checkpointing.strategies.torch",
    "MCore's async save is deprecated",
)
_TRAINING = "megatron.training.training"


def shows_everything(argv: Sequence[str]) -> bool:
    """``--verbose``: every line Megatron prints, the argument dump included."""
    return "--verbose" in argv


def quiet_megatron_info(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Keeps Megatron's loggers at WARNING unless the user chose a level; returns whether it did.

    Megatron's ``setup_logging`` sets the root level from ``--logging-level`` or
    ``MEGATRON_LOGGING_LEVEL`` and leaves it at INFO otherwise; only that last case changes here, on
    the ``megatron`` logger (megatron_ext's loggers keep the root's level).
    """
    chosen = any(a == "--logging-level" or a.startswith("--logging-level=") for a in argv)
    if chosen or "MEGATRON_LOGGING_LEVEL" in environ or shows_everything(argv):
        return False
    logging.getLogger("megatron").setLevel(logging.WARNING)
    return True


@contextlib.contextmanager
def argument_dump_when_asked() -> Iterator[None]:
    """Within the block, Megatron's ``validate_args`` prints its argument dump only for
    ``--log-arguments`` or ``--verbose``.

    Raises:
        RuntimeError: ``megatron.training.arguments._print_args`` is gone (a Megatron upgrade).
    """
    arguments = importlib.import_module("megatron.training.arguments")
    original = getattr(arguments, "_print_args", None)
    if original is None:
        raise RuntimeError("megatron_ext: megatron.training.arguments._print_args is gone")

    @functools.wraps(original)
    def print_args(title: str, args: Any) -> None:
        if getattr(args, "log_arguments", False) or getattr(args, "verbose", False):
            original(title, args)

    arguments._print_args = print_args
    try:
        yield
    finally:
        arguments._print_args = original


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefix)


def install(args: Any) -> list[str]:
    """Leaves out the lines that do not apply to this run; returns what it left out (names).

    Idempotent per process; does nothing under ``--verbose``.

    Raises:
        RuntimeError: ``report_memory`` or ``report_theoretical_memory`` is gone from
            ``megatron.training.training`` (a Megatron upgrade).
    """
    if getattr(args, "verbose", False):
        return []
    import torch

    training = importlib.import_module(_TRAINING)
    for name in ("report_memory", "report_theoretical_memory"):
        if not callable(getattr(training, name, None)):
            raise RuntimeError(f"megatron_ext: {_TRAINING}.{name} is gone")
    left_out = []
    if not torch.cuda.is_available() and args.log_memory_interval is None:
        training.report_memory = _skipped(training.report_memory, lambda *a, **k: True)
        left_out.append("report_memory")
    from megatron.training.utils import is_hybrid_model

    training.report_theoretical_memory = _skipped(
        training.report_theoretical_memory, lambda a, *rest, **kw: is_hybrid_model(a)
    )
    left_out.append("report_theoretical_memory of a HybridModel")
    if not args.async_save:
        logger = logging.getLogger(ASYNC_SAVE_DEPRECATION[0])
        if not any(isinstance(f, _DropPrefix) for f in logger.filters):
            logger.addFilter(_DropPrefix(ASYNC_SAVE_DEPRECATION[1]))
        left_out.append("async-save deprecation")
    return left_out


def _skipped(original: Any, skip: Any) -> Any:
    """``original`` that returns None without running when ``skip(*args)`` is true."""
    original = getattr(original, "_megatron_ext_original", original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return None if skip(*args, **kwargs) else original(*args, **kwargs)

    call._megatron_ext_original = original  # type: ignore[attr-defined]
    return call


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
    flags = changed_flags(args)
    return [
        f"megatron_ext: model {model}: {', '.join(parts)}, {dtype}",
        f"megatron_ext: parallel {resolved['world_size']} ranks: data {parallel['dp']}, tensor "
        f"{parallel['tp']}, pipeline {parallel['pp']}, expert {parallel['ep']} "
        f"({args.distributed_backend})",
        f"megatron_ext: data {', '.join(data)}",
        f"megatron_ext: flags {' '.join(flags) if flags else 'none (Megatron runs as is)'}",
    ]


def changed_flags(args: Any) -> list[str]:
    """megatron_ext's flags whose value is not the default, as they would be written."""
    from megatron_ext.config import FEATURE_CONFIGS, flag

    out = []
    for cls in FEATURE_CONFIGS:
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            value = getattr(args, f.name, default)
            if value == default or f.name in ("verbose", "log_arguments"):
                continue
            written = flag(f.name)
            if value is not True:
                written += f" {' '.join(map(str, value)) if isinstance(value, list) else value}"
            out.append(written)
    return out


def refuse(line: str) -> int:
    """Prints ``megatron_ext: LINE`` on stderr once per launch and returns the exit status, 2.

    The first rank (``RANK`` 0, or no ``RANK``: one process) prints at once. Another rank waits
    :data:`REFUSAL_GRACE_S` first: the first rank refuses the same arguments, and the launcher
    (torchrun, or :func:`megatron_ext.testing.real_loop.launch`) stops the other ranks when it exits;
    a refusal only some ranks see (a file one node lacks) still prints, from each of them.
    """
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        time.sleep(REFUSAL_GRACE_S)
        line += f" (rank {rank})"
    sys.stderr.write(f"megatron_ext: {line}\n")
    sys.stderr.flush()
    return 2
