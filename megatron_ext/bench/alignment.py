"""Benchmark: grouped-GEMM alignment in the token dispatcher, ours vs unaligned vs router padding.

Runs Megatron's real all-to-all and all-gather dispatchers (8 experts, top-2, fp32 rows, CPU) on
the routing of a real ``TopKRouter``, at EP=1 (one process) and EP=2 (two gloo processes). For
fp8 / mxfp8 / nvfp4, in one process per EP size:

- dispatch + combine time of Megatron's dispatcher without alignment (the bf16 path), with
  megatron_ext's alignment, and (all-to-all) with ``--moe-router-padding-for-quantization``.
  The variants are interleaved round by round, in an order balanced so that each follows every
  other equally often (:mod:`.rounds`), and the figure is the median of the per-round paired
  ratios ``ours / unaligned`` with its min and max (paired ratios cancel the drift of a shared
  machine);
- rows entering the EP all-to-all (EP=2): ours never adds any (pads are created after it);
  router padding sends extra duplicated real tokens;
- pad rows added, and whether every group ended up aligned (router padding cannot align when a
  rank has fewer tokens than the multiple: nvfp4 with 48 tokens stays unaligned);
- minor page faults per round trip: a fresh CPU tensor beyond glibc's mmap threshold faults in
  every page, which a GPU caching allocator never pays;
- ATen ops per round trip (:class:`OpCounter`, one untimed trip after the rounds): on a GPU each
  launches at least one kernel, and at a few tokens launches are most of a trip's cost there;
  the CPU times above also pay for the pad rows' data, which a GPU moves far faster.

Every figure is measured twice, under two allocator settings (column ``allocator``), each in
worker processes of its own:

- ``glibc``: malloc's defaults. Its mmap threshold moves with what the process freed before, so
  two variants of the same size can fault differently (one run measured 32770 faults per trip
  for the unaligned path and 41156 for ours, and another 40963 for both): at 8192 tokens that
  alone moves a ratio by 10 %.
- ``caching``: malloc told to keep freed memory (no mmap'd chunks, no trimming of the heap), so
  a freed tensor's pages are reused like a GPU caching allocator's blocks and 'faults/trip'
  stays near 0. The setting cannot be undone in a process, so those workers are shut down after.

Both run in fresh worker processes, so earlier benchmarks cannot move the figures; under glibc
the threshold still moves as the variants free tensors within the run ('faults/trip' shows
it), which the caching rows do not have.

Stand-in experts (a copy of their rows) run outside the timed span, so the times are the
dispatcher's own work (dispatch + combine); the experts' cost of the pad rows is the GEMMs'.
"""

import contextlib
import ctypes
import ctypes.util
import resource
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.bench.rounds import design_length, round_order
from megatron_ext.testing import run_distributed
from megatron_ext.testing.distributed import shutdown_pools

PRECISIONS = {"fp8": ("e4m3", "tensorwise", None), "mxfp8": ("e4m3", "mxfp8", None)}
PRECISIONS["nvfp4"] = (None, None, "nvfp4")
DISPATCHERS = ("alltoall", "allgather")
ALLOCATORS = ("glibc", "caching")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _keep_freed_memory() -> None:
    """glibc malloc as a caching allocator for the rest of this process (irreversible).

    No allocation is served by its own mmap (``M_MMAP_MAX`` 0) and the heap top is never given
    back (``M_TRIM_THRESHOLD`` at its maximum), so freed tensors' pages are reused.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):
        raise RuntimeError("the 'caching' allocator setting needs glibc's mallopt")
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not ok:
        raise RuntimeError("glibc's mallopt refused the 'caching' allocator setting")


def _set_precision(cfg, precision: str | None) -> None:
    fp8, recipe, fp4 = PRECISIONS.get(precision, (None, None, None))
    cfg.fp8, cfg.fp8_recipe = fp8, recipe
    cfg.fp4, cfg.fp4_recipe = ("e2m1", "nvfp4") if fp4 else (None, None)


def _round_trip(layer, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, span=None):
    """Dispatch and combine around stand-in experts.

    Returns (rows into the exchange, groups, seconds in the dispatcher, the layer's output). The
    stand-in (a copy, as an expert's output is a fresh tensor) is outside the timed span: its cost
    is the experts' (it grows with the pad rows, as the GEMMs do), not the dispatcher's.
    ``span``: a context entered around the two dispatcher spans (an :class:`OpCounter`), outside
    their timing. On a GPU the device is synchronised at each clock read (kernels run
    asynchronously), so each span holds its own kernels and nothing queued before it.
    """
    d = layer.token_dispatcher
    span = span or contextlib.nullcontext()
    sync = torch.cuda.synchronize if x.is_cuda else _no_sync
    with span:
        sync()
        start = time.perf_counter()
        h, p = d.dispatch_preprocess(x, routing_map, probs)
        rows_sent = h.shape[0]
        h, p = d.token_dispatch(h, p)
        h, tokens_per_expert, p = d.dispatch_postprocess(h, p)
        sync()
        dispatched = time.perf_counter()
    h = h * 1.0
    with span:
        sync()
        combine = time.perf_counter()
        h = d.combine_preprocess(h)
        h = d.token_combine(h)
        out = d.combine_postprocess(h)
        sync()
        done = time.perf_counter()
    return rows_sent, tokens_per_expert, (dispatched - start) + (done - combine), out


def _no_sync() -> None:
    """CPU ops finish before they return: nothing to wait for."""


class OpCounter(TorchDispatchMode):
    """Counts the ATen calls that do work, each at least one kernel on a GPU (re-enterable).

    Views and aliases are left out (their schema returns an alias that is not written), as are
    bare allocations (``empty*``: no kernel). In-place ops, copies and scalar reads count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        alias = func._schema.returns[0].alias_info if func._schema.returns else None
        view = alias is not None and not alias.is_write
        if not view and func.overloadpacket.__name__ not in _ALLOCATIONS:
            self.count += 1
        return func(*args, **(kwargs or {}))


_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


class _Variant:
    """One dispatcher setting timed in every round: a layer and the precision it runs at."""

    def __init__(
        self, layer, precision: str | None, router_padding: bool = False, inputs=None
    ) -> None:
        self.layer, self.precision, self.router_padding = layer, precision, router_padding
        self.inputs = inputs  # its own (x, probs, routing_map) instead of the round's
        self.seconds: list[float] = []
        self.faults: list[int] = []
        self.rows_sent, self.groups = 0, []
        self.ops: int | None = None  # ATen ops per trip (OpCounter), from count_ops

    @contextlib.contextmanager
    def _setting(self, x, probs, routing_map):
        """This variant's precision and router padding on its layer, no_grad; yields its inputs
        (its own, or the round's)."""
        cfg = self.layer.config
        _set_precision(cfg, self.precision)
        cfg.moe_router_padding_for_quantization = self.router_padding
        try:
            with torch.no_grad():
                yield self.inputs if self.inputs is not None else (x, probs, routing_map)
        finally:
            cfg.moe_router_padding_for_quantization = False

    def run(self, x, probs, routing_map, reps: int) -> None:
        with self._setting(x, probs, routing_map) as (x, probs, routing_map):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds = 0.0
            for _ in range(reps):
                # A fresh map each trip: Megatron's pad_routing_map writes into the one it gets.
                trip_map = routing_map.clone()
                self.rows_sent, self.groups, trip, _ = _round_trip(self.layer, x, probs, trip_map)
                seconds += trip
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        self.seconds.append(seconds / reps)
        self.faults.append(faults // reps)

    def count_ops(self, x, probs, routing_map) -> int:
        """One untimed trip under an :class:`OpCounter`: the dispatcher's ATen ops per trip."""
        counter = OpCounter()
        with self._setting(x, probs, routing_map) as (x, probs, routing_map):
            _round_trip(self.layer, x, probs, routing_map.clone(), span=counter)
        self.ops = counter.count
        return self.ops


def _build(dispatcher: str, hidden: int, aligned: bool, device: str = "cpu"):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.config import MoEAlignmentConfig
    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.testing import tiny_moe_config

    cfg = tiny_moe_config(
        hidden_size=hidden, num_attention_heads=4, moe_token_dispatcher_type=dispatcher
    )
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    if aligned:
        spec = with_aligned_moe(spec, MoEAlignmentConfig(moe_dispatch_align=True))
    torch.manual_seed(0)
    return spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False).to(device)


def _ratios(ours: _Variant, base: _Variant) -> list[float]:
    return [o / b for o, b in zip(ours.seconds, base.seconds, strict=True)]


#: The full run rounds every row's rounds up to whole Williams designs, so that each variant
#: follows every other equally often (what the notes claim); up to this many tokens per rank a
#: round costs well under a second, so those rows run :data:`FEW_TOKEN_DESIGNS` designs at
#: least (a median over more rounds, where a shared machine's noise moves a trip most).
FEW_TOKENS = 1024
FEW_TOKEN_DESIGNS = 2


def _rounds_for(num_tokens: int, rounds: int, num_variants: int, whole_designs: bool) -> int:
    """The rounds one token count runs: ``rounds`` (quick run), else at least ``rounds`` (and
    :data:`FEW_TOKEN_DESIGNS` designs for few tokens) rounded up to whole designs."""
    if not whole_designs:
        return rounds
    length = design_length(num_variants)
    wanted = rounds if num_tokens > FEW_TOKENS else max(rounds, FEW_TOKEN_DESIGNS * length)
    return -(-wanted // length) * length


def _rounds_note(rounds: int, whole_designs: bool) -> str:
    if not whole_designs:
        return f"{rounds} rounds"
    return (
        f"at least {rounds} rounds, and at up to {FEW_TOKENS} tokens/rank at least "
        f"{FEW_TOKEN_DESIGNS} designs, rounded up to whole designs (a design is as many rounds "
        "as variants, twice that for an odd count)"
    )


def measure_rows(
    token_counts: list[int],
    hidden: int,
    rounds: int,
    allocator: str,
    whole_designs: bool,
    device: str = "cpu",
) -> list[list]:
    """The table's rows for this rank's EP size. ``device``: "cpu" (gloo ranks), or "cuda" at
    EP=1 (tools/gpu/gpu_check.py; ``allocator`` is then only the label, "cuda": PyTorch's
    caching allocator)."""
    from megatron.core import parallel_state

    if allocator == "caching":
        _keep_freed_memory()
    ep = parallel_state.get_expert_model_parallel_world_size()
    rank = parallel_state.get_expert_model_parallel_rank()
    rows = []
    for dispatcher in DISPATCHERS:
        stock = _build(dispatcher, hidden, False, device)
        ours = _build(dispatcher, hidden, True, device)
        copy = _build(dispatcher, hidden, False, device)  # a second, identical unaligned layer
        for num_tokens in token_counts:
            g = torch.Generator().manual_seed(num_tokens + 1000 * rank)
            x = torch.randn(num_tokens, 1, hidden, generator=g).to(device)
            with torch.no_grad():
                probs, routing_map = stock.route(x)
            base, twin = _Variant(stock, None), _Variant(copy, None)
            mine = {p: _Variant(ours, p) for p in PRECISIONS}
            # Megatron refuses router padding for the all-gather dispatcher.
            padded = {p: _Variant(stock, p, True) for p in PRECISIONS if dispatcher == "alltoall"}
            floors = {}
            if ep == 1:  # Megatron's unaligned path carrying as many rows as ours: the data floor
                for p, v in mine.items():
                    v.run(x, probs, routing_map, 1)  # also a warm-up
                    rows_ours = sum(int(n) for n in v.groups)
                    floors[p] = _Variant(
                        stock, None, inputs=_inputs_with_rows(x, probs, routing_map, rows_ours)
                    )
                    v.seconds.clear()  # the warm-up trip is not a round
                    v.faults.clear()
            no_pad_base, no_pad = None, {}
            if ep == 1:  # ours' own cost on a routing that needs no pad row
                no_pad_base, no_pad = _no_pad_variants(stock, ours, x, probs, routing_map)
            variants = [base, twin, *mine.values(), *padded.values(), *floors.values()]
            variants += [no_pad_base, *no_pad.values()] if no_pad_base else []
            reps = max(1, 2048 // num_tokens)  # small inputs: several trips per timing
            _check_same_layer(stock, copy, x, probs, routing_map)  # also a warm-up of both
            num_rounds = _rounds_for(num_tokens, rounds, len(variants), whole_designs)
            for r in range(num_rounds):
                # Same order on every rank (the exchanges pair up), balanced per round.
                for v in round_order(variants, r):
                    v.run(x, probs, routing_map, reps)
            for v in (base, *mine.values()):
                v.count_ops(x, probs, routing_map)
            base_rows, base_groups = base.rows_sent, [int(n) for n in base.groups]
            if ep == 1 and dispatcher == "alltoall":
                assert sum(base_groups) == base_rows  # no exchange: every row sent is received
            for precision, v in mine.items():
                align = _align_of(ours, precision)
                ratios = _ratios(v, base)
                groups = [int(n) for n in v.groups]
                rp = padded.get(precision)
                rp_groups = [int(n) for n in rp.groups] if rp else None
                a2a = dispatcher == "alltoall" and ep > 1  # rows on the EP all-to-all wire
                rows.append(
                    [
                        allocator,
                        ep,
                        dispatcher,
                        precision,
                        num_tokens,
                        align,
                        round(1e3 * statistics.median(base.seconds), 3),
                        round(1e3 * statistics.median(v.seconds), 3),
                        round(statistics.median(ratios), 3),
                        round(min(ratios), 3),
                        round(max(ratios), 3),
                        num_rounds,
                        round(statistics.median(_ratios(twin, base)), 3),
                        round(statistics.median(_ratios(rp, base)), 3) if rp else "-",
                        _floor_cell(floors.get(precision), base, sum(groups)),
                        _no_pad_cell(no_pad.get(precision), no_pad_base),
                        base_rows if a2a else "-",
                        v.rows_sent if a2a else "-",
                        rp.rows_sent if (a2a and rp) else "-",
                        sum(groups) - sum(base_groups),
                        sum(rp_groups) - sum(base_groups) if rp else "-",
                        all(n % align == 0 for n in groups),
                        all(n % align == 0 for n in rp_groups) if rp else "-",
                        int(statistics.median(base.faults)),
                        int(statistics.median(v.faults)),
                        base.ops,
                        v.ops,
                    ]
                )
    return rows


def _check_same_layer(stock, copy, x, probs, routing_map) -> None:
    """The copy is the same computation as the unaligned layer: equal groups and outputs."""
    outputs = []
    with torch.no_grad():
        for layer in (stock, copy):
            _set_precision(layer.config, None)
            _, tokens_per_expert, _, out = _round_trip(layer, x, probs, routing_map.clone())
            outputs.append((tokens_per_expert.tolist(), out))
    assert outputs[0][0] == outputs[1][0] and torch.equal(outputs[0][1], outputs[1][1])


def _inputs_with_rows(x, probs, routing_map, num_rows: int):
    """The round's tokens repeated cyclically until their routed pairs number ``num_rows``."""
    topk = int(routing_map[0].sum())
    assert num_rows % topk == 0 and bool((routing_map.sum(-1) == topk).all())
    index = torch.arange(num_rows // topk, device=x.device) % x.shape[0]
    return x[index], probs[index], routing_map[index]


def no_pad_inputs(probs: torch.Tensor, routing_map: torch.Tensor, aligns: list[int]):
    """The round's routing moved so that every expert's count is a multiple of an alignment.

    Slot ``s`` of the ``T*K`` routed pairs goes to expert ``s // G`` and token ``s % T``, with
    ``G`` the smallest multiple of the largest usable ``align`` that is at least ``T*K/E``
    (``G <= T`` keeps a token's experts distinct, and ``G`` divides ``T*K``). Each token keeps
    its own top-k probabilities (descending, onto its new experts in ascending order), so the
    dispatcher's work differs from the round's only in where the rows go. Shape legend: T
    tokens, E experts, K = top-k.

    Returns:
        ``(align, probs_TE, routing_map_TE)`` for the largest ``align`` in ``aligns`` that
        allows it, or None when none does (nvfp4 with fewer tokens than 128).
    """
    num_tokens, num_experts = routing_map.shape
    topk = int(routing_map[0].sum())
    pairs = num_tokens * topk
    for align in sorted(aligns, reverse=True):
        group = align * max(1, -(-pairs // (num_experts * align)))
        if group <= num_tokens and pairs % group == 0 and pairs // group <= num_experts:
            break
    else:
        return None
    slot = torch.arange(pairs, device=routing_map.device)
    token, expert = slot % num_tokens, slot // group
    new_map = torch.zeros_like(routing_map)
    new_map[token, expert] = True
    assert bool((new_map.sum(1) == topk).all()), "a token's experts must be distinct"
    kept = probs.masked_select(routing_map).view(num_tokens, topk).sort(1, descending=True).values
    new_probs = torch.zeros_like(probs)
    new_probs[new_map] = kept.reshape(-1)  # row-major: each token's experts ascending
    return align, new_probs, new_map


def _no_pad_variants(stock, ours, x, probs, routing_map) -> tuple:
    """``(unaligned, {precision: ours})`` on :func:`no_pad_inputs`'s routing; ``(None, {})``
    when no such routing exists. Precisions whose multiple the routing does not meet are left
    out."""
    aligns = {p: _align_of(ours, p) for p in PRECISIONS}
    routing = no_pad_inputs(probs, routing_map, list(aligns.values()))
    if routing is None:
        return None, {}
    group_align, *routed = routing
    inputs = (x, *routed)
    mine = {p: _Variant(ours, p, inputs=inputs) for p, a in aligns.items() if group_align % a == 0}
    return _Variant(stock, None, inputs=inputs), mine


def _no_pad_cell(ours, base) -> float | str:
    """Median paired ratio of ours to unaligned on the no-pad routing (checked: no pad row)."""
    if ours is None:
        return "-"
    routed = int(ours.inputs[2].sum())
    assert sum(int(n) for n in ours.groups) == routed, "the no-pad routing needed a pad row"
    return round(statistics.median(_ratios(ours, base)), 3)


def _floor_cell(floor, base, rows_ours: int):
    """Median paired ratio of the floor variant to unaligned, after checking its row count."""
    if floor is None:
        return "-"
    assert sum(int(n) for n in floor.groups) == rows_ours, "the floor carries ours' rows"
    return round(statistics.median(_ratios(floor, base)), 3)


def _align_of(layer, precision: str) -> int:
    _set_precision(layer.config, precision)
    return layer.align


COLUMNS = [
    "allocator",
    "ep",
    "dispatcher",
    "precision",
    "tokens/rank",
    "align",
    "dispatch ms unaligned",
    "dispatch ms ours",
    "ours/unaligned",
    "ratio min",
    "ratio max",
    "rounds",
    "unaligned copy/unaligned",
    "router pad/unaligned",
    "unaligned at ours' rows/unaligned",
    "ours/unaligned, no pad needed",
    "a2a rows unaligned",
    "a2a rows ours",
    "a2a rows router pad",
    "pad rows ours",
    "extra rows router pad",
    "ours aligned",
    "router pad aligned",
    "faults/trip unaligned",
    "faults/trip ours",
    "ops/trip unaligned",
    "ops/trip ours",
]


@register_benchmark("alignment")
def alignment(quick: bool) -> BenchResult:
    """Dispatch time (paired ratios), all-to-all rows and pad rows at EP=1 and EP=2."""
    token_counts = [48, 1024] if quick else [48, 1024, 8192]
    hidden = 256 if quick else 1024
    rounds = 5 if quick else 15
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
    return BenchResult(
        title="MoE grouped-GEMM alignment: megatron_ext dispatcher vs unaligned and router padding",
        columns=COLUMNS,
        rows=rows,
        notes=(
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
        ),
    )
