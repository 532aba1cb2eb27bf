"""Hides warnings that do not apply to what the user runs (``--verbose`` shows everything):
``quiet_warnings()`` first thing in a CLI's ``main()``.

Importing Megatron without Transformer Engine, Apex or CUDA prints a screen of warnings announcing
the fallbacks a CPU run uses. Only those known messages are hidden, by exact prefix.
"""

import logging
import warnings

#: Warning message prefixes (``warnings.warn``) that never apply to a megatron_ext CPU / GPU run.
QUIET_WARNINGS: tuple[str, ...] = (
    "Transformer Engine and Apex are not installed",  # fallbacks to torch: what a CPU run uses
    "absl.logging is not installed",
    "Apex is not installed",
    "Transformer Engine is not installed",
    "Only transformer-engine>=1.7.0 supports MoE experts",  # local experts: what --cpu uses
    "'pin_memory' argument is set as true but no accelerator is found",  # CPU run: nothing to pin
    "MimoModelConfig is experimental",  # imported by Megatron, never used by megatron_ext
    "\n        It is recommended to use a ModelConfig",  # megatron_ext's provider, not the user's choice
    "`torch.distributed.all_gather_into_tensor` is deprecated",  # inside Megatron, not user code
    # Megatron's dataset code asks for a rank; a single-process tool has none, rank 0 is right.
    "Could not determine rank from torch.distributed",
)

#: Log records (logger name, message prefix) that never apply.
QUIET_LOGS: tuple[tuple[str, str], ...] = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),  # CPU machine: expected
    # The user chose GPTModel on purpose (no --hybrid-layer-pattern); megatron_ext supports both.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)


class _PrefixFilter(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def quiet_warnings(extra_prefixes: tuple[str, ...] = ()) -> None:
    """Installs the filters for this process (idempotent); ``extra_prefixes``: more
    ``warnings.warn`` message prefixes to hide."""
    for prefix in QUIET_WARNINGS + extra_prefixes:
        warnings.filterwarnings("ignore", message=_regex(prefix))
    for name, prefix in QUIET_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _PrefixFilter) for f in logger.filters):
            logger.addFilter(_PrefixFilter((prefix,)))


def _regex(prefix: str) -> str:
    import re

    return re.escape(prefix)
