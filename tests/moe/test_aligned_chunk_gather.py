"""Tier: pure (torch only, no Megatron). The device-planned chunk sort with pads of
megatron_ext.moe.aligned_chunk_gather: hand-worked layouts, a loop reference, invariants,
autograd, and no host sync."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.moe import aligned_chunk_gather as cg
from megatron_ext.moe import alignment as al
from megatron_ext.testing.host_sync import assert_no_host_sync, count_host_syncs


def test_identity_alignment_is_refused():
    with pytest.raises(AssertionError):
        cg.plan_aligned_layout(torch.tensor([[1]]), 1, 1, 1)


# ---------------------------------------------------------------- naive reference (loops)
def naive_aligned_buffer(x_N: torch.Tensor, counts_RE: list[list[int]], align: int):
    """Loop reference: walk chunks in arrival order, append rows per expert, pad each group."""
    num_experts = len(counts_RE[0])
    rows_per_expert: list[list[torch.Tensor]] = [[] for _ in range(num_experts)]
    src = 0
    for counts_E in counts_RE:
        for e, c in enumerate(counts_E):
            for _ in range(c):
                rows_per_expert[e].append(x_N[src])
                src += 1
    assert src == x_N.shape[0]
    out, sizes = [], []
    for rows in rows_per_expert:
        size = len(rows) if align <= 1 else -(-len(rows) // align) * align
        out.extend(rows)
        out.extend([x_N.new_zeros(x_N.shape[1:])] * (size - len(rows)))
        sizes.append(size)
    buf = torch.stack(out) if out else x_N.new_zeros((0, *x_N.shape[1:]))
    return buf, sizes


def run_layout(counts_RE: list[list[int]], align: int, dim: int = 3, static: bool = False):
    counts = torch.tensor(counts_RE, dtype=torch.long)
    num_received = int(counts.sum())
    x_N = torch.arange(1, num_received * dim + 1, dtype=torch.float32).view(num_received, dim)
    if static:
        num_rows = al.static_aligned_rows(num_received, counts.shape[1], align)
    else:
        num_rows = al.aligned_rows_from_host_counts(counts.sum(0), align)
    layout = cg.plan_aligned_layout(counts, align, num_received, num_rows)
    return x_N, layout, cg.pad_to_layout(x_N, layout)


# ---------------------------------------------------------------- hand-worked layouts
def test_hand_worked_single_chunk():
    # align 4, experts with 3 and 1 tokens, rows already expert-major:
    #   received [a b c | d]  ->  buffer [a b c _ | d _ _ _], dest_idx = [0 1 2 4], counts [4 4]
    _, layout, x_P = run_layout([[3, 1]], align=4, dim=1)
    assert layout.dest_idx_N.tolist() == [0, 1, 2, 4]
    assert layout.tokens_per_expert_E.tolist() == [4, 4]
    assert x_P.squeeze(1).tolist() == [1, 2, 3, 0, 4, 0, 0, 0]


def test_hand_worked_two_source_ranks_sorts_and_pads_in_one_scatter():
    # All-to-all order [rank][expert], counts_RE = [[1, 2], [2, 0]], align 4:
    #   received  a | b c | d e | (none)      chunks (r0,e0) (r0,e1) (r1,e0) (r1,e1)
    #   expert 0 gets a (r0) then d e (r1): 3 rows -> 4;  expert 1 gets b c: 2 rows -> 4
    #   buffer    [a d e _ | b c _ _]  so dest_idx = a:0 b:4 c:5 d:1 e:2
    _, layout, x_P = run_layout([[1, 2], [2, 0]], align=4, dim=1)
    assert layout.dest_idx_N.tolist() == [0, 4, 5, 1, 2]
    assert layout.tokens_per_expert_E.tolist() == [4, 4]
    a, b, c, d, e = 1, 2, 3, 4, 5
    assert x_P.squeeze(1).tolist() == [a, d, e, 0, b, c, 0, 0]


def test_hand_worked_fewer_tokens_than_multiple_and_empty_expert():
    # nvfp4 (128): 37 tokens on expert 1, none on expert 0 or 2.
    #   expert 0: 0 -> 0 rows, expert 1: 37 -> 128 rows at offset 0, expert 2: 0 -> 0 rows.
    x_N, layout, x_P = run_layout([[0, 37, 0]], align=128, dim=2)
    assert layout.tokens_per_expert_E.tolist() == [0, 128, 0]
    assert layout.dest_idx_N.tolist() == list(range(37))
    assert torch.equal(x_P[:37], x_N) and not x_P[37:].any()


def test_zero_tokens():
    _, layout, x_P = run_layout([[0, 0], [0, 0]], align=16)
    assert x_P.shape == (0, 3) and layout.tokens_per_expert_E.tolist() == [0, 0]
    assert cg.strip_layout(x_P, layout).shape == (0, 3)
    # A static bound for zero rows is all pads, owned by the last expert.
    _, layout, x_P = run_layout([[0, 0], [0, 0]], align=16, static=True)
    assert layout.num_rows == 16 and layout.tokens_per_expert_E.tolist() == [0, 16]
    assert not x_P.any()


# ---------------------------------------------------------------- naive reference, seeded random
CASES = {
    "random": None,
    "all_on_one_expert": lambda g, R, E: [
        [0] * (E - 1) + [int(torch.randint(1, 40, (1,), generator=g))] for _ in range(R)
    ],
    "empty_experts": lambda g, R, E: [
        [int(torch.randint(0, 9, (1,), generator=g)) if e % 2 else 0 for e in range(E)]
        for _ in range(R)
    ],
    "fewer_than_multiple": lambda g, R, E: [
        [int(torch.randint(0, 3, (1,), generator=g)) for _ in range(E)] for _ in range(R)
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("align", [16, 32, 128])
@pytest.mark.parametrize("num_chunks", [1, 2, 4])  # 1: expert-major; 2, 4: EP=2/4 uneven splits
def test_matches_naive_reference(case, align, num_chunks):
    g = torch.Generator().manual_seed(hash((case, align, num_chunks)) % 2**31)
    num_experts = 4
    for _ in range(5):
        if CASES[case] is None:
            counts_RE = torch.randint(0, 3 * align, (num_chunks, num_experts), generator=g).tolist()
        else:
            counts_RE = CASES[case](g, num_chunks, num_experts)
        x_N, layout, x_P = run_layout(counts_RE, align, dim=5)
        ref_P, ref_sizes = naive_aligned_buffer(x_N, counts_RE, align)
        assert torch.equal(x_P, ref_P)
        assert layout.tokens_per_expert_E.tolist() == ref_sizes
        assert all(s % align == 0 for s in ref_sizes)
        assert torch.equal(cg.strip_layout(x_P, layout), x_N)
        # Guard against a vacuous pass: real rows and pad rows both occurred in this case.
        assert x_N.shape[0] == 0 or (x_P.abs().sum(1) > 0).sum() == x_N.shape[0]


@pytest.mark.parametrize("align", [16, 32, 128])
def test_static_bound_matches_exact_layout_on_real_rows(align):
    g = torch.Generator().manual_seed(align)
    for num_chunks in (1, 2, 3):
        counts_RE = torch.randint(0, 2 * align, (num_chunks, 4), generator=g).tolist()
        _, exact, exact_P = run_layout(counts_RE, align)
        _, static, static_P = run_layout(counts_RE, align, static=True)
        assert static.num_rows >= exact.num_rows and static.num_rows % align == 0
        assert torch.equal(static.dest_idx_N, exact.dest_idx_N)
        assert (
            torch.equal(static_P[: exact.num_rows], exact_P)
            and not static_P[exact.num_rows :].any()
        )
        assert all(int(s) % align == 0 for s in static.tokens_per_expert_E)
        assert int(static.tokens_per_expert_E.sum()) == static.num_rows
        assert torch.equal(static.tokens_per_expert_E[:-1], exact.tokens_per_expert_E[:-1])


@settings(max_examples=60, deadline=None)
@given(
    counts_RE=st.integers(1, 4).flatmap(
        lambda e: st.lists(
            st.lists(st.integers(0, 70), min_size=e, max_size=e), min_size=1, max_size=4
        )
    ),
    align=st.sampled_from([2, 16, 32, 128]),
)
def test_invariants(counts_RE, align):
    x_N, layout, x_P = run_layout(counts_RE, align, dim=2)
    sizes = layout.tokens_per_expert_E.tolist()
    assert all(s % align == 0 for s in sizes) and sum(sizes) == x_P.shape[0]
    # Each group starts at an aligned offset and holds exactly its expert's real rows first.
    starts = [sum(sizes[:e]) for e in range(len(sizes))]
    per_expert = torch.tensor(counts_RE).sum(0).tolist()
    for e, (start, real) in enumerate(zip(starts, per_expert, strict=True)):
        assert start % align == 0
        assert (x_P[start : start + real].abs().sum(1) > 0).all()
        assert not x_P[start + real : start + sizes[e]].any()
    assert torch.equal(cg.strip_layout(x_P, layout), x_N)


# ---------------------------------------------------------------- autograd
def test_pad_and_strip_are_autograd_correct():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([[5, 0, 9], [3, 2, 0]])
    n = int(counts.sum())
    layout = cg.plan_aligned_layout(
        counts, 16, n, al.aligned_rows_from_host_counts(counts.sum(0), 16)
    )
    x_N = torch.randn(n, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w_P = torch.randn(layout.num_rows, 4, generator=g, dtype=torch.float64)
    (cg.pad_to_layout(x_N, layout) * w_P).sum().backward()
    assert torch.equal(x_N.grad, w_P[layout.dest_idx_N])

    y_P = torch.randn(layout.num_rows, 4, dtype=torch.float64, requires_grad=True)
    w_N = torch.randn(n, 4, generator=g, dtype=torch.float64)
    (cg.strip_layout(y_P, layout) * w_N).sum().backward()
    pad_rows = torch.ones(layout.num_rows, dtype=torch.bool)
    pad_rows[layout.dest_idx_N] = False
    assert pad_rows.any() and not y_P.grad[pad_rows].any()
    assert torch.equal(y_P.grad[layout.dest_idx_N], w_N)
    assert torch.autograd.gradcheck(
        lambda x: cg.pad_to_layout(x, layout), (x_N.detach().requires_grad_(),)
    )
    assert torch.autograd.gradcheck(
        lambda y: cg.strip_layout(y, layout), (y_P.detach().requires_grad_(),)
    )


# ---------------------------------------------------------------- no host sync, purity
def _align_round_trip(counts_RE: torch.Tensor, align: int, num_rows: int, x_N: torch.Tensor):
    layout = cg.plan_aligned_layout(counts_RE, align, x_N.shape[0], num_rows)
    y_P = cg.pad_to_layout(x_N, layout) * 2
    out = cg.strip_layout(y_P, layout)
    out.sum().backward()
    return layout, y_P, out


@pytest.mark.parametrize("align", [16, 32, 128], ids=["fp8", "mxfp8", "nvfp4"])
def test_alignment_path_makes_no_host_sync(align):
    counts_RE = torch.tensor([[3, 0, 7], [1, 4, 2]])
    n, e = 17, 3  # host ints the dispatcher has from the received tensor's shape
    for num_rows in (al.static_aligned_rows(n, e, align), 3 * align):
        x_N = torch.randn(n, 8, requires_grad=True)
        layout, y_P, out = assert_no_host_sync(_align_round_trip, counts_RE, align, num_rows, x_N)
        assert y_P.shape[0] == layout.num_rows == num_rows
        assert torch.equal(out, 2 * x_N) and torch.equal(x_N.grad, torch.full_like(x_N, 2.0))
    # The detector is live: the host-count helper reads values, and it is flagged.
    _, syncs = count_host_syncs(al.aligned_rows_from_host_counts, counts_RE.sum(0), align)
    assert len(syncs) == 1 and ".tolist()" in syncs[0]


@pytest.mark.parametrize("align", [16, 32, 128], ids=["fp8", "mxfp8", "nvfp4"])
def test_alignment_path_runs_on_meta_tensors(align):
    """Value reads and data-dependent shapes raise on meta tensors: a second, independent proof."""
    counts_RE = torch.tensor([[3, 0, 7], [1, 4, 2]], device="meta")
    x_N = torch.empty(17, 8, device="meta", requires_grad=True)
    _, y_P, out = _align_round_trip(counts_RE, align, al.static_aligned_rows(17, 3, align), x_N)
    assert out.shape == (17, 8) and y_P.shape[0] % align == 0
    with pytest.raises(RuntimeError, match="meta"):  # a value read does fail on meta
        counts_RE.sum().item()
