"""Counting the ATen ops a span of code runs: the kernel launches it would make on a GPU.

At a few tokens the launches are most of a dispatcher's cost on a GPU, which a CPU timing does not
show. :class:`OpCounter` counts the calls that do work::

    with OpCounter() as c:
        x.view(-1); torch.empty(3)   # a view, a bare allocation: not counted
        y = x + 1; y.mul_(2)         # out of place, in place: counted
    c.count == 2
"""

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the ATen calls that do work, each at least one kernel on a GPU (re-enterable).

    In-place ops, copies and scalar reads count; views and bare allocations do not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A view's schema returns an alias that is not written; empty* allocates without a kernel.
        alias = func._schema.returns[0].alias_info if func._schema.returns else None
        view = alias is not None and not alias.is_write
        if not view and func.overloadpacket.__name__ not in _ALLOCATIONS:
            self.count += 1
        return func(*args, **(kwargs or {}))


_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
