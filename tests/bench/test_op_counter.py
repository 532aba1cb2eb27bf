"""Tier: pure (the op counter on plain CPU tensors).

The alignment benchmark's 'ops/trip' columns count the ATen calls that do work, the kernel
launches a GPU would make: views and bare allocations are left out, everything else counts.
"""

import torch

from megatron_ext.bench.op_counter import OpCounter


def test_op_counter_counts_work_not_views_or_allocations():
    x = torch.randn(4, 4)
    with OpCounter() as counter:
        x.view(-1), x.t(), x[1:], x.select(0, 2), x.expand(2, 4, 4)  # views: no work
        torch.empty(3), x.new_empty(5)  # bare allocations: no kernel
        y = x + 1  # out of place
        y.mul_(2)  # in place
        y.sum()  # a reduction
    assert counter.count == 3
    with counter:  # re-entered: keeps counting
        x.clone()
    assert counter.count == 4
