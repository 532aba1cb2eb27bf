"""Tier: gloo ranks (1 and 2, real Megatron MoELayer on CPU). The aligning dispatchers end to end.

One ``run_distributed`` call per world size runs every check (spawning ranks costs seconds):
aligned fp8/mxfp8/nvfp4 runs reach the grouped GEMM with every group aligned and equal the
unaligned run bitwise (fp32) with the same all-to-all rows; bf16 is Megatron's path untouched
(bitwise, no pad row, no alignment copy); Megatron's router padding sends more all-to-all rows
and fails nvfp4 beside ours; host-sync counts of both paths; which path aligns (permute fold at
EP=1 and for all-gather, chunk sort at EP=2); a skip-pads stand-in (tokens routed nowhere,
``num_out_tokens`` lowered) equal to Megatron's under the same stand-in.
"""

import collections
import itertools

import pytest
import torch

from megatron_ext.testing import run_distributed

PRECISIONS = {"fp8": 16, "mxfp8": 32, "nvfp4": 128}
NUM_TOKENS = 37  # fewer than the nvfp4 multiple on purpose


def set_precision(cfg, precision: str) -> None:
    """fp8/fp4 configs cannot be built without TE; set them on the built config (no revalidation)."""
    cfg.fp8 = cfg.fp8_recipe = cfg.fp4 = cfg.fp4_recipe = None
    if precision in ("fp8", "mxfp8"):
        cfg.fp8, cfg.fp8_recipe = "e4m3", ("mxfp8" if precision == "mxfp8" else "tensorwise")
    elif precision == "nvfp4":
        cfg.fp4, cfg.fp4_recipe = "e2m1", "nvfp4"


def build_layer(
    dispatcher: str,
    *,
    aligned: bool,
    grouped_mm: bool = True,
    buffer="host_counts",
    spy=True,
    num_experts: int = 8,
    **config_overrides,
):
    """An MoE layer of ``tiny_moe_config`` (``config_overrides`` win), grouped-GEMM experts by
    default; returns ``(layer, config, groups the experts received per forward)``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.moe.layer_specs import _use_grouped_mm_experts, with_aligned_moe
    from megatron_ext.testing import tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = tiny_moe_config(
        moe_token_dispatcher_type=dispatcher, num_moe_experts=num_experts, **config_overrides
    )
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if grouped_mm:
        spec = _use_grouped_mm_experts(spec)
    if aligned:
        alignment = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_buffer=buffer)
        spec = with_aligned_moe(spec, alignment)
    torch.manual_seed(0)
    layer = spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False)
    layer.set_layer_number(1)
    groups: list[list[int]] = []
    if spy:  # records the group sizes the experts receive (a host read: off when counting syncs)
        layer.experts.register_forward_pre_hook(lambda m, args: groups.append(args[1].tolist()))
    return layer, cfg, groups


def fwd_bwd(layer, dtype=torch.float32):
    """Forward + backward on this rank's 37 tokens; returns output, input grad, param grads."""
    from megatron.core import parallel_state

    rank = parallel_state.get_expert_model_parallel_rank()
    g = torch.Generator().manual_seed(100 + rank)  # different tokens per rank: uneven EP splits
    x = torch.randn(NUM_TOKENS, 1, 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(NUM_TOKENS, 1, 64, generator=g).to(dtype)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def rows_sent(layer, dtype=torch.float32) -> tuple[tuple, int]:
    """``fwd_bwd`` while counting the hidden-state rows this rank puts into Megatron's EP
    all-to-all (dispatch and combine; the probs' all-to-all is not hidden-state traffic)."""
    from megatron.core.transformer.moe import token_dispatcher as megatron_dispatcher

    original, rows = megatron_dispatcher.all_to_all, [0]

    def counting(group, input_, *args, **kwargs):
        if input_.dim() == 2 and input_.shape[-1] == 64:
            rows[0] += input_.shape[0]
        return original(group, input_, *args, **kwargs)

    megatron_dispatcher.all_to_all = counting
    try:
        return fwd_bwd(layer, dtype), rows[0]
    finally:
        megatron_dispatcher.all_to_all = original


def aligner_calls(fn, *args):
    """Runs ``fn`` counting calls into the alignment math (layout plan, pad, strip)."""
    from megatron_ext.moe import aligned_chunk_gather as cg
    from megatron_ext.moe import aligned_chunk_sort as cs
    from megatron_ext.moe import aligned_permute as ap

    names = {
        cg: ("plan_aligned_layout", "pad_to_layout", "strip_layout"),
        cs: ("plan_chunk_layout", "pad_chunks", "strip_chunks"),
        ap: ("plan_aligned_permute", "permute_to_layout", "permute_probs", "unpermute_from_layout"),
    }
    originals = {(m, n): getattr(m, n) for m, ns in names.items() for n in ns}
    calls = collections.Counter()

    def counted(key):
        def call(*a, **k):
            calls[key[1]] += 1
            return originals[key](*a, **k)

        return call

    for key in originals:
        setattr(*key, counted(key))
    try:
        return fn(*args), calls
    finally:
        for key, original in originals.items():
            setattr(*key, original)


def _max_diff(a, b) -> float:
    out_a, xg_a, g_a = a
    out_b, xg_b, g_b = b
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    diffs = [(out_a - out_b).abs().max(), (xg_a - xg_b).abs().max()]
    diffs += [(g_a[k] - g_b[k]).abs().max() for k in g_a]
    return float(max(diffs))


def _bitwise(a, b) -> bool:
    return (
        torch.equal(a[0], b[0])
        and torch.equal(a[1], b[1])
        and a[2].keys() == b[2].keys()
        and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    )


class _SkipPads:
    """Stand-in for a skip-pads mixin: Megatron's preprocess through super(), then
    ``num_out_tokens`` lowered to the rows actually routed (pad tokens are routed nowhere)."""

    def preprocess(self, routing_map):
        out = super().preprocess(routing_map)
        self.num_out_tokens = int(routing_map.sum())  # a host read: fine in a test stand-in
        return out


def _with_skip_pads(layer) -> None:
    cls = type(layer.token_dispatcher)
    if hasattr(cls, "preprocess"):  # the all-gather dispatcher has none: it only sees the map
        layer.token_dispatcher.__class__ = type(f"SkipPads{cls.__name__}", (_SkipPads, cls), {})


def _dispatch_round_trip(layer, x, probs, routing_map):
    """The dispatcher alone, with a per-row stand-in for the experts (pad rows stay pads)."""
    d = layer.token_dispatcher
    h, p = d.dispatch_preprocess(x, routing_map, probs)
    h, p = d.token_dispatch(h, p)
    h, tokens_per_expert, p = d.dispatch_postprocess(h, p)
    h = d.combine_preprocess(h * 2.0 + p.unsqueeze(-1).to(h.dtype))
    return d.combine_postprocess(d.token_combine(h)), [int(n) for n in tokens_per_expert]


def _skip_pads_checks() -> dict:
    """Tokens routed nowhere (cleared routing-map rows) with ``num_out_tokens`` lowered to match:
    ours (fp8) against Megatron's stock dispatcher under the same stand-in, fp32."""
    from megatron.core import parallel_state

    from megatron_ext.moe import aligned_permute as ap

    rank = parallel_state.get_expert_model_parallel_rank()
    res = {}
    small_bytes = ap.SMALL_TOKENS_BYTES
    combos = (("host_counts", "small"), ("host_counts", "large"), ("static_bound", "small"))
    for dispatcher, (buffer, path) in itertools.product(("alltoall", "allgather"), combos):
        # Both ways the permute builds the buffer (a zero row appended, or index_fill_ of the
        # pads with its own backward); 37 x 64 fp32 tokens take the small one by default.
        ap.SMALL_TOKENS_BYTES = small_bytes if path == "small" else -1
        try:
            stock, _, _ = build_layer(dispatcher, aligned=False, spy=False)
            ours, cfg, _ = build_layer(dispatcher, aligned=True, buffer=buffer, spy=False)
            ours.load_state_dict(stock.state_dict())
            set_precision(cfg, "fp8")
            ours.realign()
            for layer in (stock, ours):
                _with_skip_pads(layer)
            g = torch.Generator().manual_seed(7 + rank)
            x = torch.randn(NUM_TOKENS, 1, 64, generator=g)
            with torch.no_grad():
                probs, routing_map = stock.route(x)
            dead = torch.tensor([0, 5, 9, 36])  # pad tokens: routed nowhere
            routing_map, probs = routing_map.clone(), probs.clone()
            routing_map[dead], probs[dead] = False, 0.0
            outs, grads, groups = [], [], []
            for layer in (stock, ours):
                xi = x.clone().requires_grad_()
                out, group = _dispatch_round_trip(layer, xi, probs, routing_map)
                out.sum().backward()
                outs.append(out.detach())
                grads.append(xi.grad)
                groups.append(group)
            res[dispatcher, buffer, path] = {
                "bitwise": torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]),
                "dead_out_zero": not outs[1].view(NUM_TOKENS, -1)[dead].any(),
                "live_nonzero": bool(outs[1].view(NUM_TOKENS, -1).abs().sum(1).gt(0).sum()),
                "groups": groups,
                "lowered": getattr(ours.token_dispatcher, "num_out_tokens", None),
            }
        finally:
            ap.SMALL_TOKENS_BYTES = small_bytes
    return res


def _all_checks() -> dict:
    from megatron_ext.moe.grouped_mm_linear import UnalignedGroupError
    from megatron_ext.moe.moe_layer import AlreadyAlignedPadding
    from megatron_ext.testing import count_host_syncs

    res: dict = {}
    for dispatcher in ("alltoall", "allgather"):
        ref_layer, _, ref_groups = build_layer(dispatcher, aligned=False)
        ref, res[dispatcher, "ref_a2a_rows"] = rows_sent(ref_layer)
        res[dispatcher, "ref_groups"] = ref_groups[-1]
        res[dispatcher, "ref_nonzero"] = float(ref[0].abs().max())
        for buffer in ("host_counts", "static_bound"):
            for precision in PRECISIONS:
                layer, cfg, groups = build_layer(dispatcher, aligned=True, buffer=buffer)
                layer.load_state_dict(ref_layer.state_dict())
                set_precision(cfg, precision)
                layer.realign()
                got, rows = rows_sent(layer)
                res[dispatcher, buffer, precision] = {
                    "diff": _max_diff(got, ref),
                    "bitwise": _bitwise(got, ref),
                    "a2a_rows": rows,
                    "groups": groups[-1],
                    "told_experts": isinstance(
                        layer.experts.quantization_padding, AlreadyAlignedPadding
                    ),
                }
        # SequentialMLP experts: each local expert sees exactly its aligned group (no double pad).
        seq_ref, _, _ = build_layer(dispatcher, aligned=False, grouped_mm=False)
        ref_seq = fwd_bwd(seq_ref)
        layer, cfg, groups = build_layer(dispatcher, aligned=True, grouped_mm=False)
        layer.load_state_dict(seq_ref.state_dict())
        set_precision(cfg, "nvfp4")
        layer.realign()
        rows: list[int] = []
        for expert in layer.experts.local_experts:
            expert.register_forward_pre_hook(
                lambda m, args, rows=rows: rows.append(args[0].shape[0])
            )
        got = fwd_bwd(layer)
        res[dispatcher, "sequential"] = {
            "diff": _max_diff(got, ref_seq),
            "bitwise": _bitwise(got, ref_seq),
            "rows": rows,
        }
        res[dispatcher, "sequential_groups"] = groups[-1]

        # bf16: our dispatcher against Megatron's stock one, bitwise; and the identity is real:
        # the experts get exactly the received rows (no pad row) and the alignment math (buffer
        # plan, pad copy, strip gather) never runs. Zero pad rows would change no bits, so
        # bitwise equality alone cannot tell.
        stock, _, stock_groups = build_layer(dispatcher, aligned=False)
        ours, _, our_groups = build_layer(dispatcher, aligned=True)
        ours.load_state_dict(stock.state_dict())
        stock, ours = stock.to(torch.bfloat16), ours.to(torch.bfloat16)
        expert_rows: list[int] = []
        ours.experts.register_forward_pre_hook(
            lambda m, args, rows=expert_rows: rows.append(args[0].shape[0])
        )
        stock_out = fwd_bwd(stock, torch.bfloat16)
        ours_out, calls = aligner_calls(fwd_bwd, ours, torch.bfloat16)
        res[dispatcher, "bf16"] = {
            "bitwise": _bitwise(stock_out, ours_out),
            "groups": (our_groups[-1], stock_groups[-1]),
            "expert_rows": expert_rows[-1],
            "aligner_calls": sum(calls.values()),
        }
        # The same counter sees the alignment math when it does run (fp8): not vacuous.
        set_precision(ours.config, "fp8")
        ours.realign()
        res[dispatcher, "fp8_aligner_calls"] = aligner_calls(fwd_bwd, ours, torch.bfloat16)[1]

        # Host syncs of one forward+backward: stock (unaligned) vs ours (nvfp4-aligned).
        stock, _, _ = build_layer(dispatcher, aligned=False, spy=False)
        ours, cfg, _ = build_layer(dispatcher, aligned=True, buffer="static_bound", spy=False)
        set_precision(cfg, "nvfp4")
        ours.realign()
        ours_host, _, _ = build_layer(dispatcher, aligned=True, spy=False)
        set_precision(ours_host.config, "nvfp4")
        ours_host.realign()
        res[dispatcher, "syncs"] = {
            name: count_host_syncs(fwd_bwd, layer)[1]
            for name, layer in (("stock", stock), ("static", ours), ("host", ours_host))
        }

    # Megatron's router padding (alltoall only) beside ours: fp8 aligns, nvfp4 cannot.
    for precision in ("fp8", "nvfp4"):
        layer, cfg, groups = build_layer("alltoall", aligned=False)
        set_precision(cfg, precision)
        cfg.moe_router_padding_for_quantization = True
        try:
            res["router_padding_a2a_rows", precision] = rows_sent(layer)[1]
            res["router_padding", precision] = ("ok", groups[-1])
        except UnalignedGroupError as e:
            res["router_padding", precision] = ("raised", groups[-1], str(e))
    res["skip_pads"] = _skip_pads_checks()
    return res


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def results(request):
    ws = request.param
    return ws, run_distributed(_all_checks, ws, ep=ws)


def test_aligned_runs_reach_gemm_aligned_and_equal_unaligned(results):
    ws, per_rank = results
    for res in per_rank:
        for dispatcher in ("alltoall", "allgather"):
            assert res[dispatcher, "ref_nonzero"] > 1e-3  # non-vacuous reference
            real = res[dispatcher, "ref_groups"]
            assert len(real) == 8 // ws and any(n % 16 for n in real)  # really unaligned input
            for buffer in ("host_counts", "static_bound"):
                for precision, align in PRECISIONS.items():
                    r = res[dispatcher, buffer, precision]
                    # fp32, bitwise (measured on CPU): a real row's output is its own dot
                    # products, and pad rows add exact zeros to the weight gradient.
                    assert r["bitwise"], (dispatcher, buffer, precision, r)
                    assert all(n % align == 0 for n in r["groups"]), r
                    assert all(a >= b for a, b in zip(r["groups"], real, strict=True)) and sum(
                        r["groups"]
                    ) > sum(real)
                    assert r["told_experts"]
                    if buffer == "host_counts":
                        assert r["groups"] == [-(-n // align) * align for n in real]


def test_sequential_experts_get_aligned_groups_once(results):
    _, per_rank = results
    for res in per_rank:
        for dispatcher in ("alltoall", "allgather"):
            r = res[dispatcher, "sequential"]
            assert r["bitwise"], r
            # Each expert MLP received exactly its 128-aligned group: SequentialMLP padded 0 rows.
            assert r["rows"] == res[dispatcher, "sequential_groups"]
            assert all(n % 128 == 0 for n in r["rows"]) and any(n > 0 for n in r["rows"])


def test_bf16_is_megatrons_path_untouched(results):
    """bf16: bitwise Megatron's, and no pad row, no copy: the experts receive exactly the rows
    Megatron's dispatcher received, and the alignment math never runs (it does under fp8)."""
    ws, per_rank = results
    for res in per_rank:
        for dispatcher in ("alltoall", "allgather"):
            r = res[dispatcher, "bf16"]
            assert r["bitwise"]
            ours, stock = r["groups"]
            assert ours == stock and any(n % 16 for n in stock)  # unaligned groups, unchanged
            assert r["expert_rows"] == sum(stock)  # rows reaching the GEMM = rows received
            assert r["aligner_calls"] == 0  # no aligned buffer planned, filled or stripped
            # The same counter sees the alignment math under fp8, on the expected path: the pad
            # folded into the permute (all-gather; all-to-all at EP=1), else into the chunk sort
            # after the exchange, from the host chunk counts (the device plan is for TE's fused
            # permute, which keeps them on the device; not on CPU).
            fp8 = res[dispatcher, "fp8_aligner_calls"]
            if dispatcher == "allgather" or ws == 1:
                assert fp8["plan_aligned_permute"] >= 1 and fp8["permute_to_layout"] >= 1, fp8
                assert fp8["unpermute_from_layout"] >= 1 and fp8["pad_chunks"] == 0, fp8
            else:
                assert fp8["plan_chunk_layout"] >= 1 and fp8["pad_chunks"] >= 1, fp8
                assert fp8["strip_chunks"] >= 1 and fp8["permute_to_layout"] == 0, fp8
            assert fp8["pad_to_layout"] == 0, fp8


def test_all_to_all_rows_are_unaligned_ones_and_router_padding_sends_more(results):
    """Rows of hidden states this rank sends through the EP all-to-all (dispatch + combine).

    Ours aligns after the exchange: exactly the unaligned run's rows, for every precision. Megatron's
    router padding (fp8) routes extra real tokens to fill each expert's multiple before the
    exchange: more rows on the wire."""
    ws, per_rank = results
    if ws == 1:
        pytest.skip("no EP all-to-all traffic at EP=1")
    for res in per_rank:
        unaligned = res["alltoall", "ref_a2a_rows"]
        # Out: this rank's 37 tokens x top-2; back: the rows its experts received.
        assert unaligned > 2 * NUM_TOKENS
        for buffer in ("host_counts", "static_bound"):
            for precision in PRECISIONS:
                assert res["alltoall", buffer, precision]["a2a_rows"] == unaligned
        assert res["router_padding_a2a_rows", "fp8"] > unaligned


def test_router_padding_fails_nvfp4_beside_ours(results):
    ws, per_rank = results
    for res in per_rank:
        status, groups = res["router_padding", "fp8"][:2]
        assert status == "ok" and all(n % 16 == 0 for n in groups)
        status, groups, message = res["router_padding", "nvfp4"]
        assert status == "raised" and "multiple of 128" in message
        assert any(n % 128 for n in groups)  # e.g. [37]*8 at EP=1: only real tokens to duplicate
        if ws == 1:
            assert groups == [NUM_TOKENS] * 8
        assert all(n % 128 == 0 for n in res["alltoall", "host_counts", "nvfp4"]["groups"])


def _sites(syncs: list[str]) -> collections.Counter:
    return collections.Counter(s.split(" at ")[1].split("site-packages/")[-1] for s in syncs)


def _kinds(syncs: list[str]) -> collections.Counter:
    """``(what, function)`` of each sync: the same read moved to our subclass counts the same."""
    return collections.Counter((s.split(" at ")[0], s.rsplit(" in ", 1)[1]) for s in syncs)


HOST_READ = (".tolist()", "read_host_counts")


def test_host_sync_counts(results):
    """Ours makes no sync Megatron's stock path does not; the differences are named exactly.

    On CPU the detector also counts reads of host-resident tensors (no sync on a GPU), so each
    difference is named. All-to-all: Megatron's ``sort_chunks_by_idxs`` split-size reads go;
    one read of counts Megatron already copied to the host comes in their place (EP=2: the chunk
    counts of its own chunk sort; EP=1: the exact length under ``host_counts``, none under
    ``static_bound``). All-gather: Megatron's one ``.cpu()`` copy of the counts stays, its
    ``.item()`` of that host copy becomes one ``.tolist()``, and its ``masked_select`` of the
    probs (a data-dependent shape: a real sync on a GPU) goes. ``read_host_counts`` asserts that what
    it reads is a CPU tensor.
    """
    ws, per_rank = results
    for res in per_rank:
        for dispatcher in ("alltoall", "allgather"):
            raw = res[dispatcher, "syncs"]
            stock = _kinds(raw["stock"])
            assert sum(stock.values()) > 0  # the detector sees Megatron's own syncs
            for ours in ("static", "host"):
                got = _kinds(raw[ours])
                if dispatcher == "alltoall":
                    dropped = stock - got
                    assert sum(dropped.values()) > 0, dropped
                    assert all(fn == "sort_chunks_by_idxs" for _, fn in dropped), dropped
                    reads = 1 if (ws > 1 or ours == "host") else 0
                    assert got - stock == collections.Counter({HOST_READ: reads}), got - stock
                else:
                    assert got[".cpu()", "dispatch_postprocess"] == 1  # the same one copy
                    assert stock - got == collections.Counter(
                        {
                            (".item()", "dispatch_postprocess"): 1,
                            ("masked_select", "dispatch_postprocess"): 1,
                        }
                    ), stock - got
                    assert got - stock == collections.Counter({HOST_READ: 1}), got - stock


def _tp2_checks() -> dict:
    """TP=2 x EP=2 (4 ranks), sequence parallel: the aligned all-to-all's TP gather/reduce-scatter
    against Megatron's stock dispatcher, SequentialMLP experts (expert TP=2), fp32."""
    from megatron.core import parallel_state

    res: dict = {"tp": parallel_state.get_tensor_model_parallel_world_size()}
    stock, cfg_stock, _ = build_layer("alltoall", aligned=False, grouped_mm=False, spy=False)
    res["sequence_parallel"] = cfg_stock.sequence_parallel
    ref = fwd_bwd(stock)
    res["ref_nonzero"] = float(ref[0].abs().max())
    for precision in ("fp8", "nvfp4"):
        ours, cfg, _ = build_layer("alltoall", aligned=True, grouped_mm=False, spy=False)
        ours.load_state_dict(stock.state_dict())
        set_precision(cfg, precision)
        ours.realign()
        rows: list[int] = []
        for expert in ours.experts.local_experts:
            expert.register_forward_pre_hook(
                lambda m, args, rows=rows: rows.append(args[0].shape[0])
            )
        got = fwd_bwd(ours)
        res[precision] = {"diff": _max_diff(got, ref), "bitwise": _bitwise(got, ref), "rows": rows}
    return res


def test_tp2_ep2_aligned_alltoall_equals_stock():
    per_rank = run_distributed(_tp2_checks, 4, tp=2, ep=2, sp=True)
    for res in per_rank:
        assert res["tp"] == 2 and res["sequence_parallel"] and res["ref_nonzero"] > 1e-3
        for precision, align in (("fp8", 16), ("nvfp4", 128)):
            r = res[precision]
            # fp32; the same rows in the same per-expert order, zero pad rows, and the TP
            # reduce-scatter sums in the same order on both paths: bitwise (measured on CPU).
            assert r["bitwise"], (precision, r)
            assert len(r["rows"]) == 4 and all(n % align == 0 for n in r["rows"]), r
            assert any(n > 0 for n in r["rows"])


def test_skip_pads_stand_in_routes_nowhere_and_lowers_num_out_tokens(results):
    """A skip-pads mode (a subclass lowering ``num_out_tokens`` after our preprocess,
    routing pad tokens nowhere) keeps ours equal to Megatron's under the same subclass: fp32
    outputs and input grads bitwise, pad tokens' outputs zero, groups aligned."""
    ws, per_rank = results
    for res in per_rank:
        assert len(res["skip_pads"]) == 6
        for (dispatcher, buffer, path), r in res["skip_pads"].items():
            assert r["bitwise"], (dispatcher, buffer, path)
            assert r["dead_out_zero"] and r["live_nonzero"]
            stock, ours = r["groups"]
            assert all(n % 16 == 0 for n in ours) and sum(ours) > sum(stock)
            if dispatcher == "alltoall" and ws == 1:
                # Lowered below N * topk: the 4 dead tokens' 8 pairs are gone.
                assert r["lowered"] == sum(stock) == 2 * (NUM_TOKENS - 4)


def _one_local_expert_checks() -> dict:
    """EP=2 with 2 experts: one local expert per rank (the chunk sort's single-group branch)."""
    res: dict = {}
    for dispatcher in ("alltoall", "allgather"):
        ref_layer, _, ref_groups = build_layer(dispatcher, aligned=False, num_experts=2)
        ref = fwd_bwd(ref_layer)
        for precision in ("fp8", "nvfp4"):
            layer, cfg, groups = build_layer(dispatcher, aligned=True, num_experts=2)
            layer.load_state_dict(ref_layer.state_dict())
            set_precision(cfg, precision)
            layer.realign()
            got, calls = aligner_calls(fwd_bwd, layer)
            res[dispatcher, precision] = {
                "local_experts": layer.token_dispatcher.num_local_experts,
                "bitwise": _bitwise(got, ref),
                "groups": groups[-1],
                "real": ref_groups[-1],
                "calls": dict(calls),
            }
    return res


def test_one_local_expert_pads_its_single_group():
    """One local expert per rank: the all-to-all's chunk sort has one group (no sort, the pad at
    the end); the all-gather's permute folds it as usual. Bitwise the unaligned run, aligned."""
    for res in run_distributed(_one_local_expert_checks, 2, ep=2):
        for (dispatcher, precision), r in res.items():
            align = PRECISIONS[precision]
            assert r["local_experts"] == 1 and r["bitwise"], (dispatcher, precision, r)
            assert r["groups"] == [-(-r["real"][0] // align) * align] != r["real"], r
            path = "plan_chunk_layout" if dispatcher == "alltoall" else "plan_aligned_permute"
            assert r["calls"].get(path, 0) >= 1, r["calls"]
