"""One rank's rows of the ``alignment`` benchmark (:mod:`megatron_ext.bench.alignment`).

:func:`measure_rows` runs in every rank of an EP group (gloo on CPU; on one GPU at EP=1, for
tools/gpu/gpu_check.py). For each token count it times these variants in the same interleaved
rounds::

    unaligned          Megatron's dispatcher, no alignment (the base of every ratio)
    unaligned copy     a second, identical unaligned layer (checked): the ratio identical code gets
    ours               megatron_ext's aligned dispatcher, per precision (fp8, mxfp8, nvfp4)
    router pad         Megatron's router padding, per precision (all-to-all only)
    floor (EP=1)       unaligned, given the round's tokens repeated up to ours' row count
    no pad (EP=1)      unaligned and ours on a routing needing no pad row (:func:`no_pad_inputs`)
"""

import statistics
from dataclasses import dataclass

import torch

from megatron_ext.bench.dispatcher_variant import (
    DISPATCHERS,
    PRECISIONS,
    Variant,
    build_layer,
    round_trip,
    set_precision,
)
from megatron_ext.bench.rounds import design_length, round_order
from megatron_ext.cpu.caching_malloc import keep_freed_memory

#: The table's columns: one cell each, in the order :func:`measure_rows` gives them.
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


def _ratios(ours: Variant, base: Variant) -> list[float]:
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


def measure_rows(
    token_counts: list[int],
    hidden: int,
    rounds: int,
    allocator: str,
    whole_designs: bool,
    device: str = "cpu",
) -> list[list]:
    """The table's rows for this rank's EP size, one per dispatcher, token count and precision,
    in the order of :data:`COLUMNS`. ``device``: "cpu" (gloo ranks), or "cuda" at EP=1
    (tools/gpu/gpu_check.py; ``allocator`` is then only the label, "cuda": PyTorch's caching
    allocator)."""
    from megatron.core import parallel_state

    if allocator == "caching":
        keep_freed_memory()
    ep = parallel_state.get_expert_model_parallel_world_size()
    rank = parallel_state.get_expert_model_parallel_rank()
    rows = []
    for dispatcher in DISPATCHERS:
        stock = build_layer(dispatcher, hidden, False, device)
        ours = build_layer(dispatcher, hidden, True, device)
        copy = build_layer(dispatcher, hidden, False, device)  # a second, identical unaligned layer
        for num_tokens in token_counts:
            g = torch.Generator().manual_seed(num_tokens + 1000 * rank)
            x = torch.randn(num_tokens, 1, hidden, generator=g).to(device)
            with torch.no_grad():
                probs, routing_map = stock.route(x)
            inputs = (x, probs, routing_map)
            variants = _variants(dispatcher, ep, stock, ours, copy, inputs)
            _check_same_layer(stock, copy, *inputs)  # also a warm-up of both
            num_rounds = _rounds_for(num_tokens, rounds, len(variants.timed()), whole_designs)
            _run_rounds(variants, inputs, num_rounds)
            head = [allocator, ep, dispatcher]
            rows += _precision_rows(variants, ours, head, num_tokens, num_rounds)
    return rows


@dataclass
class _Variants:
    """The variants timed together at one token count, on one input."""

    base: Variant  # Megatron's unaligned dispatcher: the base of every ratio
    twin: Variant  # a second, identical unaligned layer: what identical code measures
    mine: dict[str, Variant]  # ours, per precision
    padded: dict[str, Variant]  # Megatron's router padding, per precision (all-to-all only)
    floors: dict[str, Variant]  # EP=1: unaligned carrying as many rows as ours
    no_pad_base: Variant | None  # EP=1: unaligned on a routing needing no pad row
    no_pad: dict[str, Variant]  # EP=1: ours on that routing

    def timed(self) -> list[Variant]:
        """Every variant, in the order the rounds start from."""
        variants = [
            self.base, self.twin, *self.mine.values(), *self.padded.values(),
            *self.floors.values(),
        ]  # fmt: skip
        return variants + ([self.no_pad_base, *self.no_pad.values()] if self.no_pad_base else [])


def _variants(dispatcher: str, ep: int, stock, ours, copy, inputs: tuple) -> _Variants:
    """The variants of one token count; at EP=1 ours' trips are warmed up once here."""
    x, probs, routing_map = inputs
    mine = {p: Variant(ours, p) for p in PRECISIONS}
    # Megatron refuses router padding for the all-gather dispatcher.
    padded = {p: Variant(stock, p, True) for p in PRECISIONS if dispatcher == "alltoall"}
    floors = {}
    if ep == 1:  # Megatron's unaligned path carrying as many rows as ours: the data floor
        for p, v in mine.items():
            v.run(x, probs, routing_map, 1)  # also a warm-up
            rows_ours = sum(int(n) for n in v.groups)
            floors[p] = Variant(
                stock, None, inputs=_inputs_with_rows(x, probs, routing_map, rows_ours)
            )
            v.seconds.clear()  # the warm-up trip is not a round
            v.faults.clear()
    no_pad_base, no_pad = None, {}
    if ep == 1:  # ours' own cost on a routing that needs no pad row
        no_pad_base, no_pad = _no_pad_variants(stock, ours, x, probs, routing_map)
    return _Variants(
        Variant(stock, None), Variant(copy, None), mine, padded, floors, no_pad_base, no_pad
    )


def _run_rounds(variants: _Variants, inputs: tuple, num_rounds: int) -> None:
    """The timed rounds, then one untimed trip of the unaligned layer and ours counting ATen ops."""
    timed = variants.timed()
    reps = max(1, 2048 // inputs[0].shape[0])  # small inputs: several trips per timing
    for r in range(num_rounds):
        # Same order on every rank (the exchanges pair up), balanced per round: each variant
        # follows every other equally often.
        for v in round_order(timed, r):
            v.run(*inputs, reps)
    # On a GPU each op launches at least one kernel, and at a few tokens launches are most of a
    # trip's cost; the CPU times also pay for the pad rows' data, which a GPU moves far faster.
    for v in (variants.base, *variants.mine.values()):
        v.count_ops(*inputs)


def _precision_rows(
    variants: _Variants, ours, head: list, num_tokens: int, num_rounds: int
) -> list[list]:
    """One row per precision: ``head`` (allocator, EP, dispatcher), then :data:`COLUMNS`' cells."""
    _, ep, dispatcher = head
    base = variants.base
    base_rows, base_groups = base.rows_sent, [int(n) for n in base.groups]
    if ep == 1 and dispatcher == "alltoall":
        assert sum(base_groups) == base_rows  # no exchange: every row sent is received
    a2a = dispatcher == "alltoall" and ep > 1  # rows on the EP all-to-all wire
    rows = []
    for precision, v in variants.mine.items():
        align = _align_of(ours, precision)
        ratios = _ratios(v, base)
        groups = [int(n) for n in v.groups]
        rp = variants.padded.get(precision)
        rp_groups = [int(n) for n in rp.groups] if rp else None
        rows.append(
            [
                *head,
                precision,
                num_tokens,
                align,
                round(1e3 * statistics.median(base.seconds), 3),
                round(1e3 * statistics.median(v.seconds), 3),
                round(statistics.median(ratios), 3),
                round(min(ratios), 3),
                round(max(ratios), 3),
                num_rounds,
                round(statistics.median(_ratios(variants.twin, base)), 3),
                round(statistics.median(_ratios(rp, base)), 3) if rp else "-",
                _floor_cell(variants.floors.get(precision), base, sum(groups)),
                _no_pad_cell(variants.no_pad.get(precision), variants.no_pad_base),
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
            set_precision(layer.config, None, layer)
            _, tokens_per_expert, _, out = round_trip(layer, x, probs, routing_map.clone())
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
    mine = {p: Variant(ours, p, inputs=inputs) for p, a in aligns.items() if group_align % a == 0}
    return Variant(stock, None, inputs=inputs), mine


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
    set_precision(layer.config, precision, layer)
    return layer.align
