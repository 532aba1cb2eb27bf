"""Tier: pure (torch only, no Megatron). Shared alignment math of megatron_ext.moe.alignment:
multiples, rounding, buffer sizes, pad rows, zero rows. The layouts have their own test files."""

import numpy as np
import pytest
import torch

from megatron_ext.moe import alignment as al
from tests.import_probe import imported_from


def test_identity_alignment_is_no_op():
    n = torch.tensor([0, 3, 17])
    assert al.round_up(n, 0) is n and al.round_up(n, 1) is n
    assert al.static_aligned_rows(37, 8, 0) == 37
    assert al.aligned_rows_from_host_counts([3, 0, 5], 1) == 8


@pytest.mark.parametrize("align", [3, 16, 128])
def test_host_round_up_equals_the_device_round_up(align):
    counts = [0, 1, align - 1, align, align + 1, 5 * align, 1000]
    host = al.round_up_host(counts, align)
    assert host == al.round_up(torch.tensor(counts), align).tolist()
    assert all(h % align == 0 and 0 <= h - c < align for h, c in zip(host, counts, strict=True))
    assert al.real_and_aligned_rows_from_host_counts(torch.tensor(counts), align) == (
        sum(counts),
        sum(host),
    )


def test_module_never_imports_megatron():
    assert (
        imported_from(
            [
                "megatron_ext.moe.alignment",
                "megatron_ext.moe.aligned_permute",
                "megatron_ext.moe.aligned_chunk_sort",
                "megatron_ext.moe.aligned_chunk_gather",
            ],
            ["megatron"],
        )
        == []
    )


def test_shared_zero_rows_one_buffer_per_kind_and_its_first_row():
    """The pads' zero source: one buffer per (dtype, device, row shape), grown by doubling, and
    its one-row view (the permute's trash row) made with it, so it follows a regrowth."""
    al._ZERO_ROWS.clear()
    like = torch.ones(5, 3)
    row = al.shared_zero_row(like)
    assert row.shape == (1, 3) and not row.any()
    grown = al.shared_zero_rows(like, 10)
    assert grown.shape == (10, 3) and not grown.any()
    row = al.shared_zero_row(like)
    assert row.data_ptr() == grown.data_ptr() and row.shape == (1, 3)
    assert al.shared_zero_rows(like, 4) is grown  # big enough: the same buffer
    assert al.shared_zero_rows(like.double(), 1).dtype == torch.float64
    assert al.shared_zero_rows(torch.ones(2, 4), 1).shape == (1, 4)
    assert len(al._ZERO_ROWS) == 3


@pytest.mark.parametrize("align", [4, 16, 128])
def test_host_pad_rows_equal_the_device_pad_rows(align):
    """The pad rows listed on the host (the all-gather's host counts) are the device version's,
    with empty groups, groups already aligned, a static bound's slack and no pad at all."""
    g = torch.Generator().manual_seed(align)
    cases = [[0, 0, 0], [align, 2 * align, 0]]  # no pad row at all
    cases += [torch.randint(0, 3 * align, (6,), generator=g).tolist() for _ in range(20)]
    for counts in cases:
        aligned = al.round_up_host(counts, align)
        for slack in (0, 2 * align):
            sizes = [*aligned[:-1], aligned[-1] + slack]
            counts_E, sizes_E = torch.tensor(counts), torch.tensor(sizes)
            first_pad_E = sizes_E.cumsum(0) - sizes_E + counts_E
            num_pads = sum(sizes) - sum(counts)
            device = al.pad_rows_of_groups(first_pad_E, sizes_E - counts_E, num_pads)
            host = al.host_pad_rows(counts, sizes)
            assert host.dtype == np.int64 and host.tolist() == device.tolist()
    assert any(sum(al.round_up_host(c, align)) > sum(c) for c in cases)  # pads occurred


def test_leading_rows_gradient_is_the_slices_without_filling_kept_rows():
    """A static-bound buffer cut to its exact length: the same values and gradient as a slice
    (bitwise), the cut rows' gradient zero, and no zero fill of the whole buffer."""
    from megatron_ext.moe.alignment import leading_rows

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(10, 3, generator=g, requires_grad=True)
    ref = buf.detach().clone().requires_grad_(True)
    w = torch.randn(7, 3, generator=g)
    got = leading_rows(buf, 7)
    assert torch.equal(got, ref[:7]) and got.data_ptr() == buf.data_ptr()  # a view
    (got * w).sum().backward()
    (ref[:7] * w).sum().backward()
    assert torch.equal(buf.grad, ref.grad) and buf.grad[:7].abs().sum() > 0
    assert not buf.grad[7:].any()
    fills = []

    class Fills(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("zero_", "fill_", "zeros", "new_zeros"):
                fills.append(args[0].shape if args else kwargs)
            return func(*args, **(kwargs or {}))

    buf.grad = None
    with Fills():
        (leading_rows(buf, 7) * w).sum().backward()
    assert fills == [torch.Size([3, 3])]  # only the 3 cut rows are zeroed
    assert leading_rows(buf, 10) is not buf and torch.equal(leading_rows(buf, 10), buf)
