"""The ``alignment`` benchmark's whole-layer table: MoE layer forward + backward under both allocators.

Megatron's unaligned MoE layer (the bf16 path) and megatron_ext's aligned one (fp8, multiple 16)
whole (router, dispatcher, experts; forward and backward) at EP=1, under both allocator settings
paired round by round (:mod:`.allocator_pair`).
"""

import statistics

import torch

from megatron_ext.bench.allocator_pair import enter_half, layer_step, paired_rounds
from megatron_ext.bench.dispatcher_variant import build_layer, set_precision

#: The table's columns, in the order :func:`measure_layers` gives them.
COLUMNS = [
    "layer",
    "tokens",
    "ms glibc",
    "ms caching",
    "caching/glibc",
    "ratio min",
    "ratio max",
    "faults/step glibc",
    "faults/step caching",
    "rounds",
]

#: ``{name: (aligned, precision)}`` of the layers timed.
LAYERS = {"unaligned": (False, None), "ours fp8": (True, "fp8")}


def measure_layers(token_counts: list[int], hidden: int, rounds: int) -> dict:
    """Rows of the table and each half's peak RSS (MiB), on every rank of the 2-rank world."""
    enter_half(ep=1)  # before anything is built
    # Both layers on every rank: each half times both, under its own allocator.
    layers = {}
    for name, (aligned, precision) in LAYERS.items():
        layers[name] = build_layer("alltoall", hidden, aligned)
        set_precision(layers[name].config, precision, layers[name])
    steps = {}
    for num_tokens in token_counts:
        # Seeded by the token count: both halves feed the same input to the same layer.
        g = torch.Generator().manual_seed(num_tokens)
        x = torch.randn(num_tokens, 1, hidden, generator=g)
        for name, layer in layers.items():
            steps[(name, num_tokens)] = layer_step(layer, x)
    paired = paired_rounds(steps, rounds, ep=1)
    rows = []
    for (name, num_tokens), (median, low, high) in paired["ratio"].items():
        ms, faults = paired["ms"], paired["faults"]
        key = (name, num_tokens)
        rows.append(
            [
                name,
                num_tokens,
                round(statistics.median(ms["glibc"][key]), 2),
                round(statistics.median(ms["caching"][key]), 2),
                round(median, 3),
                round(low, 3),
                round(high, 3),
                int(statistics.median(faults["glibc"][key])),
                int(statistics.median(faults["caching"][key])),
                rounds,
            ]
        )
    return {"rows": rows, "peak_rss_mib": paired["peak_rss_mib"]}


def notes(hidden: int, rss: dict[str, float]) -> str:
    """The table's notes, with the run's peak RSS per allocator."""
    return (
        f"Megatron's MoE layer (alltoall dispatcher, 8 SequentialMLP experts, top-2, hidden "
        f"{hidden}, fp32 on CPU, EP=1) unaligned, and megatron_ext's aligned layer at fp8's "
        "multiple 16; timed: the whole layer's forward + backward (router, dispatch, experts, "
        "combine). Each (layer, tokens, allocator) ran once per round, in a balanced order, "
        "allocators in the two halves of a 2-rank world (rank 0 glibc's defaults, rank 1 the "
        "caching malloc setting every --cpu launch applies: mallopt M_MMAP_MAX 0, "
        "M_TRIM_THRESHOLD max; --no-cpu-caching-malloc turns it off), one at a time; "
        "'caching/glibc' is the median of the per-round paired ratios (min, max). What it saves "
        "is CPU page-fault cost (a fresh tensor above glibc's mmap threshold faults in every "
        "page on every step), which a GPU caching allocator never pays: it is no speed-up a GPU "
        f"run would see. Peak RSS (ru_maxrss, whole process): glibc {rss['glibc']:.0f} MiB, "
        f"caching {rss['caching']:.0f} MiB."
    )
