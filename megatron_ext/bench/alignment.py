"""Benchmark: grouped-GEMM alignment in the token dispatcher, ours vs unaligned vs router padding.

Megatron's real all-to-all and all-gather dispatchers (8 experts, top-2, fp32 rows, CPU) on the
routing of a real ``TopKRouter``, at EP=1 and EP=2, for fp8 / mxfp8 / nvfp4: dispatch + combine time
as paired per-round ratios, rows on the EP all-to-all, pad rows, page faults and ATen ops per trip,
under glibc's malloc defaults and the caching setting. This module is the registered table: it runs
:func:`.alignment_rows.measure_rows` at each EP size under each allocator, and the whole-layer table
of :mod:`.alignment_layer`; how to read them is in their notes (docs/BENCHMARKS.md).
"""

from megatron_ext.bench import alignment_layer
from megatron_ext.bench.alignment_rows import COLUMNS, FEW_TOKEN_DESIGNS, FEW_TOKENS, measure_rows
from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.testing import run_distributed
from megatron_ext.testing.distributed import shutdown_pools

# Each in worker processes of its own, so earlier benchmarks cannot move the figures. Under glibc
# the mmap threshold still moves with what the variants freed before in the run, so two variants of
# one size can fault differently (one run measured 32770 faults per trip for the unaligned path and
# 41156 for ours, another 40963 for both): at 8192 tokens that alone moves a ratio by 10 %. The
# caching setting cannot be undone in a process, so its workers are shut down after.
ALLOCATORS = ("glibc", "caching")


def _rounds_note(rounds: int, whole_designs: bool) -> str:
    if not whole_designs:
        return f"{rounds} rounds"
    return (
        f"at least {rounds} rounds, and at up to {FEW_TOKENS} tokens/rank at least "
        f"{FEW_TOKEN_DESIGNS} designs, rounded up to whole designs (a design is as many rounds "
        "as variants, twice that for an odd count)"
    )


@register_benchmark("alignment")
def alignment(quick: bool) -> BenchResult:
    """Dispatch time (paired ratios), all-to-all rows and pad rows at EP=1 and EP=2."""
    token_counts = [48, 1024] if quick else [48, 1024, 8192]
    hidden = 256 if quick else 1024
    rounds = 3 if quick else 15
    rows = _dispatcher_rows(token_counts, hidden, rounds, quick)
    return BenchResult(
        title="MoE grouped-GEMM alignment: megatron_ext dispatcher vs unaligned and router padding",
        columns=COLUMNS,
        rows=rows,
        notes=_notes(hidden, rounds, quick),
        tables=[_layer_table(hidden, quick)],
    )


def _dispatcher_rows(token_counts: list[int], hidden: int, rounds: int, quick: bool) -> list:
    """Rank 0's rows at EP=1 and EP=2 under each allocator setting, each in fresh workers."""
    rows = []
    for allocator in ALLOCATORS:
        shutdown_pools()  # fresh workers: nothing run before moves malloc's thresholds
        for ep in (1, 2):
            per_rank = run_distributed(
                measure_rows,
                ep,
                token_counts,
                hidden,
                rounds,
                allocator,
                not quick,
                ep=ep,
                timeout=1800,
            )
            rows += per_rank[0]  # rank 0's timings; the exchanges keep the ranks in step
    shutdown_pools()  # the 'caching' workers keep their setting: none serves anything else
    return rows


def _layer_table(hidden: int, quick: bool) -> BenchResult:
    """The second table: the whole MoE layer, forward + backward, under both allocators."""
    layer_tokens = [256] if quick else [1024, 8192]
    layer_rounds = 3 if quick else 9
    whole = run_distributed(
        alignment_layer.measure_layers, 2, layer_tokens, hidden, layer_rounds, ep=1, timeout=1800
    )[0]
    shutdown_pools()
    return BenchResult(
        title="Whole MoE layer forward + backward: glibc's malloc defaults vs the caching setting",
        columns=alignment_layer.COLUMNS,
        rows=whole["rows"],
        notes=alignment_layer.notes(hidden, whole["peak_rss_mib"]),
    )


def _notes(hidden: int, rounds: int, quick: bool) -> str:
    """How the dispatcher table was measured and how to read it."""
    return (
        f"Megatron's all-to-all and all-gather dispatchers, 8 experts, top-2, hidden {hidden}, "
        "fp32 rows on CPU (gloo), no_grad; timed: dispatch + combine, the stand-in experts (a "
        "copy of their rows, which grows with the pad rows as the GEMMs do) outside it. Variants "
        "interleaved round by round in one process per EP size (order balanced so each "
        "follows every other equally often; small inputs repeat the trip within a timing): "
        + _rounds_note(rounds, not quick)
        + " (column 'rounds'); "
        "'ours/unaligned' is the median of the per-round paired ratios, with their min and "
        "max; rank 0 of EP=2. 'unaligned "
        "copy/unaligned': a second, identical unaligned layer timed as one more variant, "
        "checked to compute the same: the ratio identical code gets here (1 up to the "
        "machine's noise and the effect of the order), to read the others against. The pad is "
        "folded into Megatron's permute for all-gather and for all-to-all at EP=1, and into "
        "Megatron's chunk sort after the exchange (host counts it already holds) at EP=2. "
        "'a2a rows' = hidden rows entering the EP "
        "all-to-all (EP=2): ours pads after it, so it equals the unaligned count; router "
        "padding routes duplicated real tokens (prob 0) through it and cannot reach the "
        "multiple when a rank has too few tokens (nvfp4, 48 tokens). 'unaligned at ours' rows' "
        "(EP=1): Megatron's unaligned dispatcher given the round's tokens repeated until "
        "it carries as many rows as our aligned buffer, over unaligned: what that many "
        "rows cost Megatron's own path, with no planning at all (its per-token work grows "
        "with them too). 'no pad needed' (EP=1): the round's routing moved so every "
        "expert's count is already a multiple (whole groups of tokens per expert, each "
        "token keeping its own top-2 probs), ours over unaligned on that routing, checked "
        "to add no pad row: ours' own cost beside Megatron's, no pad row's data in it ('-': "
        "no such routing, nvfp4 at 48 tokens). 'allocator' (each in fresh worker "
        "processes): glibc = malloc defaults, tensors above its mmap threshold are fresh "
        "mmaps whose pages fault in on every trip ('faults/trip'), and that threshold moves "
        "with what the variants freed before in the run, so variants of one size can fault "
        "differently; caching "
        "= malloc keeping freed memory (mallopt M_MMAP_MAX 0, M_TRIM_THRESHOLD max), pages "
        "reused as a GPU caching allocator reuses its blocks. 'ops/trip': ATen calls that "
        "do work in one dispatch + combine, counted in one untimed trip (views and bare "
        "allocations left out); on a GPU each launches at least one kernel (a sort, cumsum or "
        "masked_select several, and masked_select also waits for the device). A copy of a "
        "CPU tensor to the host is no op here and one copy on a GPU, for both (Megatron's "
        ".cpu() of the counts, kept by ours)."
    )
