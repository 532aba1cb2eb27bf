"""Detects device-to-host synchronisations in a function, with or without a GPU.

On a GPU a sync stalls the CPU until the device queue drains; in MoE dispatch that serialises every
layer. On CPU there is no queue to stall, so we catch the *operations* that would sync on a device:

- value reads at the Python level (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``,
  ``np.asarray(t)``, ``str(t)``/``repr(t)``/f-strings, ``bool(t)``, ``int(t)``, ``float(t)``,
  ``torch.equal``), seen by a ``TorchFunctionMode``;
- data-dependent output shapes at the ATen level (``nonzero``, ``masked_select``, boolean-mask indexing,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, ``_local_scalar_dense``) and copies
  of device memory to host, seen by a ``TorchDispatchMode``.

A boolean-mask *assignment* follows ATen's ``_index_put_impl_``: one bool/uint8 mask on ``self``'s device,
a one-element host value (a Python scalar) and ``accumulate=False`` dispatch to ``masked_fill_`` with the
value's ``.item()`` read on the host (``canDispatchToMaskedFill``), so ``x[mask] = 1`` is not a sync. A
device-tensor value, ``accumulate=True`` or several indices take the ``nonzero`` path: a sync. On CPU every
tensor stands for a device tensor, so a one-element CPU *tensor* value is reported (write a Python scalar).

With CUDA, ``torch.cuda.set_sync_debug_mode("error")`` is armed as well, which is the ground truth there.

Example::

    assert_no_host_sync(torch.cumsum, counts_E, 0)        # passes
    assert_no_host_sync(lambda t: t.sum().item(), counts_E)  # raises AssertionError naming `.item()`
"""

import contextlib
import sys
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
    torch.Tensor.__array__: "np.asarray(tensor)",
    torch.Tensor.__repr__: "str(tensor)/repr(tensor)",
    torch.Tensor.__format__: "format(tensor)/f-string",
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


def _caller() -> tuple[str, str]:
    """The innermost frame outside torch and this module: ``(report line, module name)``."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and path != __file__:
            where = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
            return where, str(frame.f_globals.get("__name__", ""))
        frame = frame.f_back
    return "<unknown>", ""


def _frame() -> str:
    """The caller's frame, for the report."""
    return _caller()[0]


class _FunctionSpy(TorchFunctionMode):
    def __init__(self, events: list[str], depth: list[int], host_value: list[bool]) -> None:
        super().__init__()
        self.events, self.depth, self.host_value = events, depth, host_value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and len(args) == 3:
            return self._setitem(func, args, kwargs)
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

    def _setitem(self, func, args, kwargs):
        """``x[key] = value``: a Python-number value reaches ATen as a host scalar (a wrapped
        number), which the dispatch level cannot tell from a tensor; note it for the call."""
        value = args[2]
        previous = self.host_value[0]
        self.host_value[0] = isinstance(value, (bool, int, float, complex))
        try:
            return func(*args, **kwargs)
        finally:
            self.host_value[0] = previous


class _DispatchSpy(TorchDispatchMode):
    def __init__(self, events: list[str], depth: list[int], host_value: list[bool]) -> None:
        super().__init__()
        self.events, self.depth, self.host_value = events, depth, host_value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth[0] == 0:
            name = _DISPATCH_SYNCS.get(func)
            if name is None:
                name = _data_dependent(func, args, kwargs, host_value=self.host_value[0])
            if name is not None:
                self.events.append(f"{name} at {_frame()}")
        return func(*args, **kwargs)


def _moves_to_host(args: tuple, kwargs: dict) -> bool:
    """``t.to("cpu")`` / ``t.to(torch.device("cpu"))`` / ``t.to(device="cpu")``.

    On a machine without CUDA every tensor stands for a device tensor, so a CPU tensor's move to
    the host is flagged too, with one exception: inside the Megatron modules where CPU mode turns
    ``torch.cuda.current_device()`` into the string ``"cpu"`` (``megatron_ext.cpu.model_stack``), a ``.to("cpu")``
    of a CPU tensor is that device placement, a no-op on a GPU.
    """
    device = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            device = arg
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if device is None or source is None or torch.device(device).type != "cpu":
        return False
    if source.device.type != "cpu":
        return True
    if torch.cuda.is_available():
        return False  # a host tensor on a GPU machine: a host-to-host no-op
    from megatron_ext.cpu.model_stack import _CURRENT_DEVICE_USERS  # imports only torch

    placement = isinstance(device, str) and _caller()[1] in _CURRENT_DEVICE_USERS
    return not placement


def _masked_put_syncs(args: tuple, kwargs: dict, host_value: bool) -> bool:
    """ATen's ``_index_put_impl_``: False where it dispatches to ``masked_fill_`` (no sync).

    ``canDispatchToMaskedFill``: ``accumulate`` is False, the value has one element and lives on
    the host, and the indices hold exactly one bool/uint8 tensor, on ``self``'s device (the rest
    ``None``). Anything else with a boolean mask calls ``nonzero`` on the device: a sync.
    """
    self_, indices = args[0], (args[1] if len(args) > 1 else kwargs.get("indices", ()))
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    given = [i for i in indices if i is not None]
    value_on_host = host_value or (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and self_.device.type != "cpu"
    )
    masked_fill = (
        not accumulate
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and value_on_host
        and len(given) == 1
        and given[0].dtype in (torch.bool, torch.uint8)
        and given[0].device == self_.device
    )
    return not masked_fill


def _data_dependent(func: Any, args: tuple, kwargs: dict, *, host_value: bool) -> str | None:
    """Names ATen calls whose sync depends on their arguments (``host_value``: the value being
    assigned came from Python as a number)."""
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
            if packet is _aten.index or _masked_put_syncs(args, kwargs, host_value):
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
    host_value = [False]
    with contextlib.ExitStack() as stack:
        if torch.cuda.is_available():
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        stack.enter_context(_DispatchSpy(events, depth, host_value))
        stack.enter_context(_FunctionSpy(events, depth, host_value))
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
