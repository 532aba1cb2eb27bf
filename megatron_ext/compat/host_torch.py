"""Per-function CPU stand-ins for ``torch.cuda`` calls: the named Megatron function, and only it, sees a
``torch`` whose named CUDA calls run on the host.

Every other function of the module, and every other ``torch`` attribute, is untouched. Example::

    HostTorch(cuda=("current_device",))   # Router.gating: torch.cuda.current_device() -> "cpu"
    # Router.gating's `torch.cuda.current_device()` returns "cpu"; TopKRouter.routing's torch is torch.

Pure Python and torch: nothing here imports Megatron.
"""

import contextlib
import dis
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class NullStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: CPU work is already ordered."""

    def wait_stream(self, stream: Any) -> None:
        del stream

    def record_event(self, event: Any = None) -> "NullStream":
        del event
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        del event

    def query(self) -> bool:
        return True


_NULL = NullStream()


def _host(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU (anything else unchanged)."""
    if device is None:
        return None
    # A bare index is a CUDA device to torch (``torch.zeros(2, device=0)``).
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return "cpu"
    return device


def _host_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A tensor factory (``torch.tensor``, ``zeros``, ...) that allocates CUDA requests on the host."""

    @functools.wraps(factory)
    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return factory(*args, device=_host(device), **kwargs)

    return make


def _cpu_rng_state(device: Any = "cuda") -> torch.Tensor:
    del device
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
    del device
    torch.set_rng_state(state)


#: The CPU stand-in of each ``torch.cuda`` name a :class:`HostTorch` may override.
CUDA_ON_HOST: dict[str, Any] = {
    "current_device": lambda: "cpu",
    "device_count": lambda: 1,
    "set_device": lambda *a, **k: None,
    "synchronize": lambda *a, **k: None,
    "empty_cache": lambda: None,
    "Stream": lambda *a, **k: _NULL,
    "Event": lambda *a, **k: _NULL,
    "current_stream": lambda *a, **k: _NULL,
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "get_rng_state": _cpu_rng_state,
    "set_rng_state": _set_cpu_rng_state,
    "manual_seed": torch.manual_seed,
    # The target's (H100/H200), as validate_on_target answers.
    "get_device_capability": lambda device=None: (9, 0),
}

#: Tensor factories a :class:`HostTorch` with ``factories=True`` allocates on the host.
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "rand", "randn")


class _CudaProxy(types.SimpleNamespace):
    """``torch.cuda`` with selected attributes overridden; everything else falls through."""

    # Only for names not set on the instance: an unnamed CUDA call still goes to CUDA (and fails
    # on a CPU-only machine).
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class TorchProxy(types.ModuleType):
    """``torch`` with selected ``torch.cuda`` names and top-level factories overridden."""

    def __init__(self, cuda: dict[str, Any], top: dict[str, Any]) -> None:
        super().__init__("torch")
        self.cuda = _CudaProxy(**cuda)
        for name, value in top.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@dataclass(frozen=True)
class HostTorch:
    """A table replacement: the named function reads these ``torch`` names as their CPU stand-ins.

    Attributes:
        cuda: ``torch.cuda`` names (keys of :data:`CUDA_ON_HOST`) the function calls on the host.
        factories: Whether ``torch.tensor/zeros/ones/empty/full/rand/randn`` allocate
            ``device="cuda"`` (or a device index) on the host.
    """

    cuda: tuple[str, ...] = ()
    factories: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.cuda) - set(CUDA_ON_HOST)
        assert not unknown, f"no CPU stand-in for torch.cuda.{sorted(unknown)}"

    def proxy(self) -> TorchProxy:
        top = {name: _host_factory(getattr(torch, name)) for name in FACTORIES}
        return TorchProxy({n: CUDA_ON_HOST[n] for n in self.cuda}, top if self.factories else {})


def innermost_function(obj: Any, filename: str) -> types.FunctionType:
    """The plain function behind ``obj`` (a staticmethod, classmethod or decorator chain): the
    innermost one whose code is in ``filename``, the body a :class:`HostTorch` rebinds."""
    # Innermost: a decorator defined in the same file wraps the body in a function of that file too.
    found = None
    while obj is not None:
        obj = getattr(obj, "__func__", obj)
        if isinstance(obj, types.FunctionType) and obj.__code__.co_filename == filename:
            found = obj
        obj = getattr(obj, "__wrapped__", None)
    if found is None:
        raise RuntimeError(f"no function defined in {filename} to rebind")
    return found


#: ``(code, alias)`` -> the renamed code: renaming reads every instruction (``dis``), about 0.3 s
#: of CPU for the CPU group's rows, paid once per process, or once per preloaded launch server
#: (:func:`megatron_ext.compat.patch.prepare`) instead of once per forked rank.
_RENAMED: dict[tuple[types.CodeType, str], types.CodeType] = {}


def _renamed(code: types.CodeType, alias: str) -> types.CodeType:
    """``code`` (and the code nested in it) reading the global ``torch`` as ``alias``.

    Raises:
        RuntimeError: ``torch`` is also used there other than as a global read (an attribute, an
            import, a store), which a rename would change too.
    """
    # Cached: a pure function of the code object (which compares by its whole content) and alias.
    key = (code, alias)
    done = _RENAMED.get(key)
    if done is None:
        done = _RENAMED[key] = _rename(code, alias)
    return done


def _rename(code: types.CodeType, alias: str) -> types.CodeType:
    consts = tuple(
        _renamed(c, alias) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    if "torch" not in code.co_names:
        return code.replace(co_consts=consts)
    # Renaming co_names renames every use of the name: only global reads may be "torch".
    for ins in dis.get_instructions(code):
        if ins.argval == "torch" and ins.opname != "LOAD_GLOBAL" and ins.opcode in dis.hasname:
            raise RuntimeError(f"{code.co_qualname} uses 'torch' in {ins.opname}: cannot rebind")
    names = tuple(alias if n == "torch" else n for n in code.co_names)
    return code.replace(co_names=names, co_consts=consts)


def renamed_code(function: types.FunctionType, alias: str) -> types.CodeType:
    """The code :func:`rebind` would give ``function`` (computed and cached, nothing changed)."""
    return _renamed(function.__code__, alias)


def rebind(function: types.FunctionType, alias: str) -> types.CodeType:
    """Makes ``function`` read the global ``torch`` as the global ``alias``; returns its old code."""
    # In place, so every reference to the function object sees it; the alias holds a TorchProxy
    # with exactly the row's overrides (HostTorch.proxy).
    original = function.__code__
    function.__code__ = _renamed(original, alias)
    return original
