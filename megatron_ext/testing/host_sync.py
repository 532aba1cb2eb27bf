"""Detects device-to-host synchronisations in a function, with or without a GPU.

On a GPU a sync stalls the CPU until the device queue drains; in MoE dispatch that serialises every
layer. On CPU there is no queue to stall, so we catch the *operations* that would sync on a device:

- value reads at the Python level (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool(t)``,
  ``int(t)``, ``float(t)``, ``torch.equal``), seen by a ``TorchFunctionMode``;
- data-dependent output shapes at the ATen level (``nonzero``, ``masked_select``, boolean-mask indexing,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, ``_local_scalar_dense``) and copies
  of device memory to host, seen by a ``TorchDispatchMode``.

With CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is armed as well, which is the ground truth there.

Example::

    assert_no_host_sync(torch.cumsum, counts_E, 0)        # passes
    assert_no_host_sync(lambda t: t.sum().item(), counts_E)  # raises AssertionError naming `.item()`
"""

import contextlib
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

_FUNCTION_SYNCS: dict[Any, str] = {
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "tensor used as an index/size",
    torch.equal: "torch.equal",
}

_DISPATCH_SYNCS: dict[Any, str] = {
    _aten._local_scalar_dense.default: "_local_scalar_dense (a scalar read)",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.bincount.default: "bincount",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.is_nonzero.default: "is_nonzero",
    _aten.equal.default: "equal",
}


def _frame() -> str:
    """The innermost stack frame outside torch and this module, for the report."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/" not in path and path != __file__:
            return f"{path}:{frame.lineno} in {frame.name}"
    return "<unknown>"


class _FunctionSpy(TorchFunctionMode):
    def __init__(self, events: list[str], depth: list[int]) -> None:
        super().__init__()
        self.events, self.depth = events, depth

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _FUNCTION_SYNCS.get(func)
        if name is None and func is torch.Tensor.to and _moves_to_host(args, kwargs):
            name = ".to('cpu')"
        if name is None:
            return func(*args, **kwargs)
        self.events.append(f"{name} at {_frame()}")
        self.depth[0] += 1  # the ATen ops it issues are the same sync: do not count them again
        try:
            return func(*args, **kwargs)
        finally:
            self.depth[0] -= 1


class _DispatchSpy(TorchDispatchMode):
    def __init__(self, events: list[str], depth: list[int]) -> None:
        super().__init__()
        self.events, self.depth = events, depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth[0] == 0:
            name = _DISPATCH_SYNCS.get(func)
            if name is None:
                name = _data_dependent(func, args, kwargs)
            if name is not None:
                self.events.append(f"{name} at {_frame()}")
        return func(*args, **kwargs)


def _moves_to_host(args: tuple, kwargs: dict) -> bool:
    """``t.to("cpu")`` from a device tensor. A CPU tensor's ``.to("cpu")`` is not flagged: in CPU mode
    that is Megatron's ``.to(torch.cuda.current_device())``, a device-to-device no-op on a GPU."""
    device = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            device = arg
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return (
        device is not None
        and torch.device(device).type == "cpu"
        and source is not None
        and source.device.type != "cpu"
    )


def _data_dependent(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Names ATen calls whose sync depends on their arguments."""
    packet = func.overloadpacket
    if packet is _aten.repeat_interleave and kwargs.get("output_size") is None:
        if func is _aten.repeat_interleave.Tensor or (
            len(args) > 1 and isinstance(args[1], torch.Tensor)
        ):
            return "repeat_interleave without output_size"
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        ):
            return "boolean-mask indexing"
    if packet is _aten._to_copy:
        src, device = args[0], kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and src.device.type != "cpu":
            return "device-to-host copy"
    if packet is _aten.copy_ and args[0].device.type == "cpu" and args[1].device.type == "cuda":
        return "device-to-host copy"
    return None


@contextlib.contextmanager
def record_host_syncs() -> Iterator[list[str]]:
    """Context manager yielding the list that collects every host sync made inside it."""
    events: list[str] = []
    depth = [0]
    with contextlib.ExitStack() as stack:
        if torch.cuda.is_available():
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        stack.enter_context(_DispatchSpy(events, depth))
        stack.enter_context(_FunctionSpy(events, depth))
        yield events


def count_host_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """Runs ``fn`` and returns ``(result, syncs)``, one description per device-to-host sync."""
    with record_host_syncs() as events:
        result = fn(*args, **kwargs)
    return result, list(events)


def assert_no_host_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``fn`` and fails if it performs a device-to-host synchronisation.

    Returns:
        ``fn``'s result.

    Raises:
        AssertionError: Listing each sync and where it happened.
    """
    result, events = count_host_syncs(fn, *args, **kwargs)
    if events:
        name = getattr(fn, "__qualname__", repr(fn))
        raise AssertionError(f"{name} made {len(events)} host sync(s):\n  " + "\n  ".join(events))
    return result
