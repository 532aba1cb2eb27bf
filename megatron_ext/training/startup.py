"""Startup of ``megatron_ext.pretrain_gpt`` on the megatron-core wheel: no ``make`` when the helpers exist.

``initialize_megatron`` -> ``_compile_dependencies`` calls ``megatron.core.datasets.utils.compile_helpers``,
which runs ``make -C .../megatron/core/datasets``. The megatron-core 0.19.2 wheel ships the compiled
``helpers_cpp`` extension but no Makefile, so ``make`` fails and Megatron exits ("Failed to compile the
C++ dataset helper functions") on every machine, GPU included. :func:`skip_helpers_build_when_prebuilt`
replaces that one function: when ``megatron.core.datasets.helpers_cpp`` imports, there is nothing to
build; otherwise Megatron's own ``compile_helpers`` runs exactly as before (a source checkout).

Example::

    skip_helpers_build_when_prebuilt()     # before megatron.training.pretrain
"""

import functools
import importlib
from collections.abc import Callable
from typing import Any


def prebuilt_helpers_available() -> bool:
    """Whether Megatron's compiled dataset helpers (``helpers_cpp``) import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def skip_helpers_build_when_prebuilt() -> None:
    """Makes ``compile_helpers`` a no-op when the prebuilt extension imports. Idempotent."""
    utils = importlib.import_module("megatron.core.datasets.utils")
    original: Callable[[], Any] = utils.compile_helpers
    if getattr(original, "_megatron_ext", False):
        return

    @functools.wraps(original)
    def compile_helpers() -> Any:
        if prebuilt_helpers_available():
            return None
        return original()

    compile_helpers._megatron_ext = True  # type: ignore[attr-defined]
    utils.compile_helpers = compile_helpers
