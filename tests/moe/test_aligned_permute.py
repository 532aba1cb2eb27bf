"""Tier: pure (torch only), plus comparisons with Megatron's own permute/unpermute functions (imported,
no process groups). The pad folded into the permute (megatron_ext.moe.aligned_permute) and the padded
chunk sort from host counts (megatron_ext.moe.aligned_chunk_sort). That
these modules never import megatron is checked in test_alignment.py (one subprocess)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.moe import aligned_chunk_gather as cg
from megatron_ext.moe import aligned_chunk_sort as cs
from megatron_ext.moe import aligned_permute as ap
from megatron_ext.moe import alignment as al
from megatron_ext.testing.host_sync import assert_no_host_sync


# ---------------------------------------------------------------- naive references (loops)
def naive_permute(x_TD, routing_map_TE, probs_TE, align, num_rows):
    """Expert-major, tokens ascending within an expert, each group zero-padded to ``align``;
    the last group takes the slack up to ``num_rows``."""
    num_tokens, num_experts = routing_map_TE.shape
    rows, probs, tokens, sizes = [], [], [], []
    for e in range(num_experts):
        n = 0
        for t in range(num_tokens):
            if routing_map_TE[t, e]:
                rows.append(x_TD[t])
                probs.append(probs_TE[t, e])
                tokens.append(t)
                n += 1
        size = -(-n // align) * align
        if e == num_experts - 1:
            size = num_rows - sum(sizes)
        rows += [x_TD.new_zeros(x_TD.shape[1:])] * (size - n)
        probs += [probs_TE.new_zeros(())] * (size - n)
        tokens += [None] * (size - n)
        sizes.append(size)
    if not rows:
        return x_TD.new_zeros((0, *x_TD.shape[1:])), probs_TE.new_zeros(0), tokens, sizes
    return torch.stack(rows), torch.stack(probs), tokens, sizes


def naive_unpermute(y_PD, tokens, num_tokens):
    out = y_PD.new_zeros((num_tokens, *y_PD.shape[1:]))
    for p, t in enumerate(tokens):  # buffer order: Megatron's accumulation order
        if t is not None:
            out[t] += y_PD[p]
    return out


def random_routing(num_tokens, num_experts, topk, seed, dead_rows=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    top = logits.topk(min(topk, num_experts), dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    routing_map[torch.randperm(num_tokens, generator=g)[:dead_rows]] = False  # routed nowhere
    probs = torch.softmax(logits, 1) * routing_map
    return routing_map, probs, g


def plan(routing_map, align, static=False, host_starts=False):
    """The layout; ``host_starts``: the groups' starts handed in from host counts (what the
    dispatchers holding Megatron's host counts do), not computed from the map, and the ranks
    handed in too."""
    num_out = int(routing_map.sum())
    if static:
        rows = al.static_aligned_rows(num_out, routing_map.shape[1], align)
    else:
        rows = al.aligned_rows_from_host_counts(routing_map.sum(0), align)
    start_E = rank_TE = host_sizes = None
    if host_starts:  # and the ranks the caller took the counts from, as the all-gather does
        counts = routing_map.sum(0).tolist()
        aligned = [-(-n // align) * align for n in counts]
        start_E = torch.tensor([sum(aligned[:e]) for e in range(len(aligned))])
        rank_TE = ap.rank_within_expert(routing_map)
        assert torch.equal(ap.counts_from_ranks(rank_TE), routing_map.sum(0))
        aligned[-1] += rows - sum(aligned)  # a static bound's slack joins the last group
        host_sizes = (counts, aligned)
    layout = ap.plan_aligned_permute(
        routing_map,
        align,
        num_out,
        rows,
        exact=not static,
        start_E=start_E,
        rank_TE=rank_TE,
        host_sizes=host_sizes,
    )
    # The ranks are only read: the all-gather's host counts may alias their last row (CPU).
    assert rank_TE is None or torch.equal(rank_TE, ap.rank_within_expert(routing_map))
    return layout


@pytest.fixture(params=["small", "large"])
def token_path(request, monkeypatch):
    """Both ways of building the buffer: gather from the tokens plus one zero row (small
    inputs), or gather then zero only the pad rows (``index_fill_``, a custom backward)."""
    if request.param == "large":
        monkeypatch.setattr(ap, "SMALL_TOKENS_BYTES", -1)
    return request.param


# ---------------------------------------------------------------- hand-worked
def test_hand_worked_permute(token_path):
    # align 4; token 0 -> e0, e1; token 1 -> e1; token 2 -> e0 (the module docstring's case):
    #   Megatron's permute [t0 t2 | t0 t1]; aligned buffer [t0 t2 _ _ | t0 t1 _ _]
    routing_map = torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.bool)
    layout = plan(routing_map, 4)
    assert layout.token_idx_P.tolist() == [0, 2, 3, 3, 0, 1, 3, 3]  # 3 = T: the trash row
    assert layout.pair_idx_P.tolist() == [0, 4, 6, 6, 1, 3, 6, 6]  # t * E + e; 6 = T * E
    assert layout.tokens_per_expert_E.tolist() == [4, 4]
    assert sorted(layout.pad_idx_Q.tolist()) == [2, 3, 6, 7]
    x = torch.tensor([[1.0], [2.0], [3.0]])
    assert ap.permute_to_layout(x, layout).squeeze(1).tolist() == [1, 3, 0, 0, 1, 2, 0, 0]
    probs = torch.tensor([[0.1, 0.2], [0.9, 0.3], [0.4, 0.8]])  # unrouted 0.9 and 0.8 dropped
    assert ap.permute_probs(probs, layout).tolist() == pytest.approx(
        [0.1, 0.4, 0, 0, 0.2, 0.3, 0, 0]
    )
    y = torch.arange(1.0, 9.0).unsqueeze(1)  # expert outputs, pad rows 3, 4, 7, 8 non-zero
    # token 0 <- rows 0 and 4 (1 + 5), token 1 <- row 5 (6), token 2 <- row 1 (2); pads dropped
    assert ap.unpermute_from_layout(y, layout).squeeze(1).tolist() == [6, 6, 2]


def test_hand_worked_chunk_layout():
    # The docstring's case: align 4, counts_RE = [[1, 2], [2, 0]], received a | b c | d e | -
    layout = cs.plan_chunk_layout([[1, 2], [2, 0]], 4)
    assert layout.buffer_sizes == [1, 2, 1, 2, 0, 2] and layout.source_C == [0, 2, -1, 1, 3, -1]
    assert layout.tokens_per_expert_E == [4, 4] and layout.num_rows == 8 and layout.max_pad == 2
    x = torch.arange(1.0, 6.0).unsqueeze(1)  # a..e
    x_P = cs.pad_chunks(x, layout, torch.zeros(2, 1))
    assert x_P.squeeze(1).tolist() == [1, 4, 5, 0, 2, 3, 0, 0]  # [a d e _ | b c _ _]
    assert torch.equal(cs.strip_chunks(x_P * 10, layout), x * 10)


# ---------------------------------------------------------------- naive reference, random
CASES = {  # (tokens, experts, topk, dead rows)
    "random": (37, 8, 2, 0),
    "routed_nowhere": (37, 8, 2, 5),
    "one_expert": (20, 1, 1, 0),
    "all_on_one_expert": (40, 4, 1, 0),
    "fewer_than_multiple": (3, 4, 2, 0),
    "zero_tokens": (0, 4, 2, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("align", [16, 128])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("host_starts", [False, True], ids=["device_starts", "host_starts"])
def test_permute_matches_naive_reference(case, align, static, host_starts, token_path):
    num_tokens, num_experts, topk, dead = CASES[case]
    routing_map, probs, g = random_routing(num_tokens, num_experts, topk, align, dead)
    if case == "all_on_one_expert":
        routing_map = torch.zeros_like(routing_map)
        routing_map[:, -1] = True
        probs = routing_map.float()
    x = torch.randn(num_tokens, 6, generator=g)
    layout = plan(routing_map, align, static, host_starts)
    ref_x, ref_p, tokens, sizes = naive_permute(x, routing_map, probs, align, layout.num_rows)
    assert torch.equal(ap.permute_to_layout(x, layout), ref_x)
    assert torch.equal(ap.permute_probs(probs, layout), ref_p)
    if host_starts:  # the caller's host counts are the group sizes
        assert layout.tokens_per_expert_E is None
    else:
        assert layout.tokens_per_expert_E.tolist() == sizes and all(s % align == 0 for s in sizes)
    y = torch.randn(layout.num_rows, 6, generator=g)  # pad rows too: they must be dropped
    # fp32, same accumulation order as the loop (buffer order): bitwise.
    assert torch.equal(ap.unpermute_from_layout(y, layout), naive_unpermute(y, tokens, num_tokens))
    # Guard against vacuous passes: pads and real rows occurred (bar the empty case).
    assert (layout.token_idx_P == num_tokens).any() or layout.num_rows == 0 == num_tokens
    assert num_tokens == 0 or (layout.token_idx_P < num_tokens).sum() == routing_map.sum()


def test_static_plan_narrowed_is_the_exact_plan():
    routing_map, probs, g = random_routing(37, 8, 2, 0, dead_rows=3)
    exact, static = plan(routing_map, 16), plan(routing_map, 16, static=True)
    assert static.num_rows > exact.num_rows  # the static bound really had slack
    narrowed = static.narrow(exact.num_rows)
    assert torch.equal(narrowed.token_idx_P, exact.token_idx_P)
    assert torch.equal(narrowed.pair_idx_P, exact.pair_idx_P)
    x = torch.randn(37, 4, generator=g)
    assert torch.equal(
        ap.permute_to_layout(x, static)[: exact.num_rows], ap.permute_to_layout(x, exact)
    )


def test_plans_share_one_arange_buffer_of_the_largest_size():
    """Plans of many token counts (variable-length batches) share one index buffer per device,
    and a plan reading a buffer longer than its pairs equals one reading exactly ``arange``."""
    ap._ARANGES.clear()
    like = torch.zeros(1, dtype=torch.long)
    buffers = [ap._arange_buffer(n, like) for n in (10, 100, 50, 0, 100)]
    assert [b.numel() for b in buffers] == [10, 100, 100, 100, 100]  # rebuilt once, at 100
    assert all(b is buffers[1] for b in buffers[1:])
    assert list(ap._ARANGES) == [torch.device("cpu")] and torch.equal(buffers[1], torch.arange(100))
    routing_map, _, _ = random_routing(37, 8, 2, 0)
    long_plan = plan(routing_map, 16)  # 296 pairs: grows the buffer, reads it only
    assert torch.equal(ap._ARANGES[torch.device("cpu")], torch.arange(37 * 8))
    ap._arange_buffer(10_000, like)  # a longer buffer from a larger batch
    assert ap._ARANGES[torch.device("cpu")].numel() == 10_000
    again = plan(routing_map, 16)
    assert torch.equal(again.pair_idx_P, long_plan.pair_idx_P)
    assert torch.equal(ap._ARANGES[torch.device("cpu")], torch.arange(10_000))  # never written


@pytest.mark.parametrize(
    ("deterministic", "dtype", "hidden", "topk"),
    [
        (False, torch.float32, 5, 2),
        (True, torch.float32, 5, 2),
        (False, torch.float32, 256, 2),
        # Top-4: a token sums 4 rows, where rounding after each add and accumulating in fp32
        # would differ in bf16/fp16 (at top-2 they cannot): the kernels' order really is tested.
        (False, torch.bfloat16, 256, 4),
        (False, torch.float16, 256, 4),
    ],
)
def test_equals_megatrons_permute_and_unpermute_with_grads(
    deterministic, dtype, hidden, topk, token_path
):
    """Real rows equal Megatron's permute output in order; unpermute, and the gradients of the
    tokens and the probs, equal Megatron's bitwise: on CPU our unpermute's ``index_add_`` sums in
    the order of Megatron's ``scatter_add_`` (non-deterministic mode), also in bf16 and fp16."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    routing_map, probs, g = random_routing(64, 8, topk, 0, dead_rows=4)
    num_out = int(routing_map.sum())
    x = torch.randn(64, hidden, generator=g).to(dtype)
    w = torch.randn(num_out, hidden, generator=g).to(dtype)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        x1, p1 = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, out_p, sorted_idx, _, _ = permute(x1, routing_map, probs=p1, num_out_tokens=num_out)
        ref = unpermute((out * w * out_p.unsqueeze(1)).to(dtype), sorted_idx, x.shape)
        (ref * ref).sum().backward()

        layout = plan(routing_map, 16)
        real = layout.token_idx_P < 64
        w_P = torch.zeros(layout.num_rows, hidden, dtype=dtype).masked_scatter_(
            real.unsqueeze(1), w
        )
        x2, p2 = x.clone().requires_grad_(), probs.clone().requires_grad_()
        buf, buf_p = ap.permute_to_layout(x2, layout), ap.permute_probs(p2, layout)
        assert torch.equal(buf[real], out.detach()) and torch.equal(buf_p[real], out_p.detach())
        got = ap.unpermute_from_layout((buf * w_P * buf_p.unsqueeze(1)).to(dtype), layout)
        (got * got).sum().backward()
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(got, ref) and ref.abs().sum() > 0
    assert torch.equal(x2.grad, x1.grad) and torch.equal(p2.grad, p1.grad)
    assert p2.grad[~routing_map].abs().sum() == 0 and p2.grad[routing_map].abs().sum() > 0


class _OpNames(TorchDispatchMode):
    """The ATen ops called inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_no_pad_layout_gathers_the_tokens_like_megatron(token_path):
    """When every group is already a multiple (no pad row), the buffer is Megatron's permute
    output exactly, built by Megatron's one gather: no zero row appended, no rows zeroed; the
    gradients equal Megatron's bitwise."""
    from megatron.core.transformer.moe.moe_utils import permute

    # 32 tokens, top-2 over 4 experts, each expert routed exactly 16 tokens (align 16).
    expert_of = torch.arange(64) // 16
    token_of = torch.arange(64) % 32
    routing_map = torch.zeros(32, 4, dtype=torch.bool)
    routing_map[token_of, expert_of] = True
    assert (routing_map.sum(1) == 2).all() and (routing_map.sum(0) == 16).all()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 5, generator=g)
    for host_starts in (False, True):
        layout = plan(routing_map, 16, host_starts=host_starts)
        assert layout.num_pads == 0 and layout.num_rows == 64  # the case under test
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref, _, _, _, _ = permute(x1, routing_map, num_out_tokens=64)
        ops = _OpNames()
        with ops:
            got = ap.permute_to_layout(x2, layout)
        assert ops.names == ["index_select"], ops.names
        assert torch.equal(got, ref)
        w = torch.randn(64, 5, generator=g)
        (ref * w).sum().backward()
        (got * w).sum().backward()
        assert torch.equal(x2.grad, x1.grad) and x1.grad.abs().sum() > 0


def test_permute_autograd_is_the_gather_adjoint(token_path):
    routing_map, probs, g = random_routing(11, 4, 2, 0, dead_rows=2)
    layout = plan(routing_map, 8)
    x = torch.randn(11, 3, dtype=torch.float64, generator=g, requires_grad=True)
    p = probs.double().requires_grad_()
    y = torch.randn(layout.num_rows, 3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ap.permute_to_layout(t, layout), (x,))
    assert torch.autograd.gradcheck(lambda t: ap.permute_probs(t, layout), (p,))
    assert torch.autograd.gradcheck(lambda t: ap.unpermute_from_layout(t, layout), (y,))
    # Pad rows of the expert output get no gradient.
    ap.unpermute_from_layout(y, layout).sum().backward()
    pads = layout.token_idx_P == 11
    assert pads.any() and not y.grad[pads].any() and y.grad[~pads].all()


def test_backward_keeps_buffer_sized_indices_not_the_routing_map(token_path):
    """What the permute saves for backward is [P]-sized (plus the [T, E] probs' own shape): a
    [T, E] int64 map per layer would cost more than Megatron's own bool map and probs."""
    num_tokens, num_experts = 64, 32  # many local experts: T * E = 2048 > P
    routing_map, probs, g = random_routing(num_tokens, num_experts, 2, 0)
    layout = plan(routing_map, 16, host_starts=True)
    assert num_tokens * num_experts > 2 * layout.num_rows  # the case where the size shows
    saved = []

    def pack(t):
        saved.append((t.numel(), t.dtype))
        return t

    x = torch.randn(num_tokens, 4, generator=g, requires_grad=True)
    p = probs.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ap.permute_to_layout(x, layout)
        ap.permute_probs(p, layout)
    indices = [n for n, dtype in saved if not dtype.is_floating_point]
    assert indices and max(indices) <= layout.num_rows, saved


# ---------------------------------------------------------------- chunk layout (host counts)
@pytest.mark.parametrize("align", [16, 128])
@pytest.mark.parametrize("num_chunks", [1, 2, 4])
def test_chunk_layout_matches_device_layout_and_strips(align, num_chunks):
    """The host-count chunk sort builds the same buffer as the device inverse-index gather
    (itself checked against a loop in test_aligned_chunk_gather.py); the strip restores the arrival order;
    grads flow to real rows only."""
    g = torch.Generator().manual_seed(align + num_chunks)
    max_pads = []
    for case in range(4):
        counts = torch.randint(0, 2 * align, (num_chunks, 4), generator=g)
        if case == 1:
            counts[:, :-1] = 0  # all on one expert
        if case == 2:
            counts = torch.randint(0, 3, (num_chunks, 4), generator=g)  # fewer than the multiple
        n = int(counts.sum())
        for static in (False, True):
            rows = al.static_aligned_rows(n, 4, align) if static else None
            layout = cs.plan_chunk_layout(counts.tolist(), align, rows)
            device = cg.plan_aligned_layout(counts, align, n, layout.num_rows)
            x = torch.randn(n, 3, generator=g, requires_grad=True)
            x_P = cs.pad_chunks(x, layout, torch.zeros(layout.max_pad, 3))
            assert torch.equal(x_P, cg.pad_to_layout(x, device))
            assert layout.tokens_per_expert_E == device.tokens_per_expert_E.tolist()
            assert all(s % align == 0 for s in layout.tokens_per_expert_E)
            w = torch.randn(n, 3, generator=g)
            (cs.strip_chunks(x_P * 2, layout) * w).sum().backward()
            assert torch.equal(x.grad, 2 * w)
            max_pads.append(layout.max_pad)
    assert max(max_pads) > 0  # pads occurred


def test_chunk_layout_zero_rows():
    layout = cs.plan_chunk_layout([[0, 0], [0, 0]], 16)
    x = torch.zeros(0, 3)
    assert layout.num_rows == 0 and cs.pad_chunks(x, layout, torch.zeros(1, 3)).shape == (0, 3)
    static = cs.plan_chunk_layout([[0, 0], [0, 0]], 16, al.static_aligned_rows(0, 2, 16))
    x_P = cs.pad_chunks(x, static, torch.zeros(static.max_pad, 3))
    assert static.tokens_per_expert_E == [0, 16] and x_P.shape == (16, 3) and not x_P.any()
    assert cs.strip_chunks(x_P, static).shape == (0, 3)


@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
def test_pad_rows_from_host_sizes_are_the_topk_pad_rows(static):
    """Given the host sizes (the all-gather holds them), the pad rows are listed on the host,
    and they are exactly the rows the device ``topk`` finds (ascending here, any order there)."""
    for seed in range(6):
        routing_map, _, _ = random_routing(37, 8, 2, seed, dead_rows=seed)
        host, device = plan(routing_map, 16, static, True), plan(routing_map, 16, static)
        assert host.host_sizes is not None and device.host_sizes is None
        rows = host.pad_idx_Q
        assert rows.tolist() == sorted(device.pad_idx_Q.tolist()) and rows.numel() > 0
        assert bool((host.pair_idx_P[rows] == 37 * 8).all())  # each one is a pad row


# ---------------------------------------------------------------- no host sync
def _permute_round_trip(routing_map, probs, x, align, num_out, num_rows):
    layout = ap.plan_aligned_permute(routing_map, align, num_out, num_rows)
    buf = ap.permute_to_layout(x, layout) * ap.permute_probs(probs, layout).unsqueeze(1)
    out = ap.unpermute_from_layout(buf, layout.narrow(num_rows))
    out.sum().backward()
    return layout, out


@pytest.mark.parametrize("align", [16, 32, 128])
def test_permute_path_makes_no_host_sync(align, token_path):
    routing_map, probs, g = random_routing(29, 4, 2, 0, dead_rows=3)
    num_out = int(routing_map.sum())  # host ints the dispatcher has (num_out_tokens, bound)
    rows = al.static_aligned_rows(num_out, 4, align)
    x = torch.randn(29, 8, generator=g, requires_grad=True)
    p = probs.clone().requires_grad_()
    layout, out = assert_no_host_sync(_permute_round_trip, routing_map, p, x, align, num_out, rows)
    assert layout.num_rows == rows and out.shape == x.shape and x.grad.abs().sum() > 0
    # Meta tensors: a value read or data-dependent shape would raise here.
    meta = [t.detach().to("meta") for t in (routing_map, probs, x)]
    _, out = _permute_round_trip(
        meta[0], meta[1].requires_grad_(), meta[2].requires_grad_(), align, num_out, rows
    )
    assert out.shape == x.shape and out.device.type == "meta"
