"""Startup of ``megatron_ext.pretrain_gpt``: no ``make`` when the helpers exist; a ``--cpu`` launch that
imports only what it uses and compiles nothing (docs/rehearse.md). Example::

    print(prepare_cpu_launch())            # --cpu, before anything imports Megatron
    skip_helpers_build_when_prebuilt()     # before megatron.training.pretrain
"""

import ast
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_ext.common.process_exit import die_with_parent


def prebuilt_helpers_available() -> bool:
    """Whether Megatron's compiled dataset helpers (``helpers_cpp``) import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def compile_only_without_prebuilt(original: Callable[[], Any]) -> Callable[[], Any]:
    """``compile_helpers`` that builds nothing when the prebuilt extension imports."""
    # initialize_megatron -> _compile_dependencies runs `make -C .../megatron/core/datasets`. The
    # megatron-core 0.19.2 wheel ships the compiled helpers_cpp but no Makefile, so make fails and
    # Megatron exits ("Failed to compile the C++ dataset helper functions") on every machine, GPU
    # included. A source checkout without the extension still builds it as before.

    @functools.wraps(original)
    def compile_helpers() -> Any:
        if prebuilt_helpers_available():
            return None
        return original()

    return compile_helpers


def skip_helpers_build_when_prebuilt() -> None:
    """Makes ``compile_helpers`` a no-op when the prebuilt extension imports. Idempotent."""
    from megatron_ext import compat

    compat.apply_rows([compat.row("megatron.core.datasets.utils.compile_helpers")])


#: Megatron's package of tokenizer libraries; its ``__init__`` imports every library eagerly, the
#: Hugging Face one (and with it ``transformers``, seconds on a small machine) included.
TOKENIZER_LIBRARIES = "megatron.core.tokenizers.text.libraries"


def _library_exports(init: Path) -> dict[str, str]:
    """``{name: submodule}`` of a package ``__init__`` made only of ``from SUBMODULE import NAME``.

    Raises:
        RuntimeError: The ``__init__`` holds anything else (Megatron changed it: deferring it could
            leave something undone).
    """
    exports: dict[str, str] = {}
    for node in ast.parse(init.read_text()).body:
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            raise RuntimeError(
                f"megatron_ext: {init} is no longer a list of 'from MODULE import NAME'; "
                "deferring its imports needs a new look (see megatron_ext/training/startup.py)"
            )
        for alias in node.names:
            exports[alias.asname or alias.name] = node.module
    return exports


def defer_tokenizer_libraries() -> bool:
    """Registers Megatron's tokenizer-library package so each library is imported when first named
    (no ``transformers`` for a ``NullTokenizer`` run). A no-op once the package is imported.

    Returns:
        True if the package was registered deferred, False if it was already imported.
    """
    # megatron/core/tokenizers/text/libraries/__init__.py is nothing but seven
    # `from .X import Tokenizer` lines, and every launch reaches it (text_tokenizer imports its
    # abstract_tokenizer), so a NullTokenizer run imported transformers for the Hugging Face
    # wrapper it never builds.
    if TOKENIZER_LIBRARIES in sys.modules:
        return False
    megatron_spec = importlib.util.find_spec("megatron")
    assert megatron_spec is not None and megatron_spec.submodule_search_locations
    root = Path(next(iter(megatron_spec.submodule_search_locations)))
    package_dir = root.joinpath(*TOKENIZER_LIBRARIES.split(".")[1:])
    init = package_dir / "__init__.py"
    exports = _library_exports(init)
    spec = importlib.util.spec_from_file_location(
        TOKENIZER_LIBRARIES, init, submodule_search_locations=[str(package_dir)]
    )
    assert spec is not None
    package = importlib.util.module_from_spec(spec)  # not executed: that is the point

    # Its real __path__, so submodules import as before; MegatronTokenizerText._restore_model's
    # getattr(libraries, class_name) then imports huggingface_tokenizer (and transformers)
    # exactly when a Hugging Face tokenizer is asked for.
    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {TOKENIZER_LIBRARIES!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(package, name, value)
        return value

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    package.__all__ = list(exports)  # type: ignore[attr-defined]
    sys.modules[TOKENIZER_LIBRARIES] = package
    return True


def run_jit_fuser_eagerly() -> None:
    """Runs Megatron's ``jit_fuser`` functions as plain Python, as the tests and the demo always have:
    same math, no compile time, one set of losses for every ``--cpu`` launch."""
    # jit_fuser is torch.compile (torch >= 2.2), applied when each fusion module is imported, and
    # torch.compile returns the function unchanged when TORCHDYNAMO_DISABLE is 1 at that moment:
    # so before Megatron is imported.
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    # A fusion module imported already: Dynamo's config.disable runs its wrapper eagerly too.
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True


def prepare_cpu_launch(caching_malloc: bool = True) -> str:
    """What a ``--cpu`` launch does before Megatron is imported; returns the line that says so.

    Args:
        caching_malloc: glibc malloc keeps freed memory for reuse (``--no-cpu-caching-malloc``: False).
    """
    run_jit_fuser_eagerly()
    defer_tokenizer_libraries()
    if caching_malloc:
        from megatron_ext.cpu.caching_malloc import keep_freed_memory

        keep_freed_memory()
    return (
        "megatron_ext: --cpu runs Megatron's jit_fuser functions eagerly (TORCHDYNAMO_DISABLE=1, "
        "as the tests and the demo) and imports tokenizer libraries only when one is used"
        + ("; malloc keeps freed memory for reuse" if caching_malloc else "")
    )


def fork_checkpoint_results_queue(args: Any) -> bool:
    """A run that saves ``torch_dist`` checkpoints (a ``--cpu`` one: the entry calls this) gets the
    results queue of Megatron's checkpoint writer from a forked manager process, made before
    Megatron initializes; returns whether it made one. Nothing is patched.
    """
    # Left to Megatron's first torch_dist save (FileSystemWriterAsync, synchronous saves included),
    # get_write_results_queue() makes a manager from the spawn context: a fresh interpreter that
    # imports torch to unpickle the write results, 3.2 s of the tiny test model's first save on a
    # 2-core machine (0.17 s forked). Megatron makes the same queue with mp_mode="fork" for its
    # persistent async-save worker (megatron.training.async_utils.init_persistent_async_worker),
    # and once per process, so every later save uses this one. Before Megatron initializes: no
    # process group and no dataloader workers to fork yet.
    global _FORKING_THE_QUEUE, _FORK_HOOK_REGISTERED
    from megatron_ext.config.megatron_view import MegatronView

    view = MegatronView.from_args(args)
    if not view.save or view.ckpt_format != "torch_dist":
        return False
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not _FORK_HOOK_REGISTERED:
        os.register_at_fork(after_in_child=_manager_dies_with_the_rank)
        _FORK_HOOK_REGISTERED = True
    _FORKING_THE_QUEUE = True
    try:
        filesystem_async.get_write_results_queue(mp_mode="fork")
    finally:
        _FORKING_THE_QUEUE = False
    return True


#: True only while :func:`fork_checkpoint_results_queue` forks the manager (the children of other
#: forks, dataloader workers among them, are left as they are).
_FORKING_THE_QUEUE = False
_FORK_HOOK_REGISTERED = False


def _manager_dies_with_the_rank() -> None:
    """In the forked manager: killed when the rank that forked it dies (Linux)."""
    # Made at startup, it would otherwise outlive a rank stopped by a signal (torchrun's SIGTERM
    # after a peer failed) for the whole run, not only after the first save as Megatron's can.
    if _FORKING_THE_QUEUE:
        die_with_parent()
