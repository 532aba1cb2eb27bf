"""Benchmark: grouped-GEMM alignment in the token dispatcher, ours vs Megatron's router padding.

Runs Megatron's real all-to-all dispatcher (EP=1, 8 local experts, top-2, fp32 rows, CPU) on the
routing of a real ``TopKRouter``. For fp8 / mxfp8 / nvfp4, side by side in one run:

- dispatch time: Megatron's dispatch + combine round trip without alignment (bf16 path), with
  megatron_ext's alignment, and with ``--moe-router-padding-for-quantization``;
- rows sent through the all-to-all: ours never adds any (pads are created after it); router
  padding sends extra duplicated real tokens;
- pad rows added, and whether every group ended up aligned (router padding cannot align when a
  rank has fewer tokens than the multiple: nvfp4 with few tokens stays unaligned).

Experts are skipped (identity) so the times isolate the dispatcher's own work.
"""

import statistics
import time

import torch

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.testing import run_distributed

PRECISIONS = {"fp8": ("e4m3", "tensorwise", None), "mxfp8": ("e4m3", "mxfp8", None)}
PRECISIONS["nvfp4"] = (None, None, "nvfp4")


def _set_precision(cfg, precision: str | None) -> None:
    fp8, recipe, fp4 = PRECISIONS.get(precision, (None, None, None))
    cfg.fp8, cfg.fp8_recipe = fp8, recipe
    cfg.fp4, cfg.fp4_recipe = ("e2m1", "nvfp4") if fp4 else (None, None)


def _round_trip(layer, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Dispatch and combine with identity experts; returns (rows sent, group sizes)."""
    d = layer.token_dispatcher
    h, p = d.dispatch_preprocess(x, routing_map, probs)
    rows_sent = h.shape[0]
    h, p = d.token_dispatch(h, p)
    h, tokens_per_expert, p = d.dispatch_postprocess(h, p)
    h = d.combine_preprocess(h * 1.0)
    h = d.token_combine(h)
    d.combine_postprocess(h)
    return rows_sent, [int(n) for n in tokens_per_expert]


def _worker(token_counts: list[int], hidden: int, repeats: int) -> list[list]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.config import MoEAlignmentConfig
    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.testing import tiny_moe_config

    def build(aligned: bool):
        cfg = tiny_moe_config(hidden_size=hidden, num_attention_heads=4)
        spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
        if aligned:
            spec = with_aligned_moe(spec, MoEAlignmentConfig(moe_dispatch_align=True))
        torch.manual_seed(0)
        return spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False), cfg

    rows = []
    for num_tokens in token_counts:
        stock, stock_cfg = build(False)
        ours, ours_cfg = build(True)
        g = torch.Generator().manual_seed(num_tokens)
        x = torch.randn(num_tokens, 1, hidden, generator=g)
        with torch.no_grad():
            probs, routing_map = stock.route(x)

        def timed(layer, x=x, probs=probs, routing_map=routing_map) -> tuple[float, int, list]:
            times, out = [], None
            for _ in range(repeats):
                start = time.perf_counter()
                with torch.no_grad():
                    out = _round_trip(layer, x, probs, routing_map)
                times.append(time.perf_counter() - start)
            return 1e3 * statistics.median(times), *out

        _set_precision(stock_cfg, None)
        stock_cfg.moe_router_padding_for_quantization = False
        base_ms, base_rows, base_groups = timed(stock)
        for precision in PRECISIONS:
            _set_precision(ours_cfg, precision)
            ours_ms, ours_rows, ours_groups = timed(ours)
            _set_precision(stock_cfg, precision)
            stock_cfg.moe_router_padding_for_quantization = True
            rp_ms, rp_rows, rp_groups = timed(stock)
            stock_cfg.moe_router_padding_for_quantization = False
            align = ours.align
            rows.append(
                [
                    precision,
                    num_tokens,
                    align,
                    round(base_ms, 3),
                    round(ours_ms, 3),
                    round(ours_ms / base_ms, 2),
                    round(rp_ms, 3),
                    base_rows,
                    ours_rows,
                    rp_rows,
                    sum(ours_groups) - base_rows,
                    rp_rows - base_rows,
                    all(n % align == 0 for n in ours_groups),
                    all(n % align == 0 for n in rp_groups),
                ]
            )
            assert sum(base_groups) == base_rows
    return rows


@register_benchmark("alignment")
def alignment(quick: bool) -> BenchResult:
    """Dispatch time, all-to-all rows and pad rows: ours vs Megatron's router padding."""
    token_counts = [48, 1024] if quick else [48, 1024, 8192]
    hidden = 256 if quick else 1024
    repeats = 5 if quick else 20
    (rows,) = run_distributed(_worker, 1, token_counts, hidden, repeats)
    return BenchResult(
        title="MoE grouped-GEMM alignment: megatron_ext dispatcher vs Megatron router padding",
        columns=[
            "precision",
            "tokens/rank",
            "align",
            "dispatch ms unaligned",
            "dispatch ms ours",
            "ours/unaligned",
            "dispatch ms router pad",
            "a2a rows unaligned",
            "a2a rows ours",
            "a2a rows router pad",
            "pad rows ours",
            "extra rows router pad",
            "ours aligned",
            "router pad aligned",
        ],
        rows=rows,
        notes=(
            f"Megatron all-to-all dispatcher, EP=1, 8 experts, top-2, hidden {hidden}, fp32 rows "
            f"on CPU, median of {repeats} dispatch+combine round trips with identity experts. "
            "'a2a rows' = rows entering the all-to-all; ours pads after it, so it equals the "
            "unaligned count; router padding routes duplicated real tokens (prob 0) through it "
            "and cannot reach the multiple when a rank has too few tokens (nvfp4, 48 tokens)."
        ),
    )
