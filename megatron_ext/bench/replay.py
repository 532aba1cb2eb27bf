"""Benchmark: route replay memory and forward time, ours vs Megatron's RouterReplay vs native.

One rank, real tiny MoE ``GPTModel`` (local spec, 8 experts, top-2, CPU, one intra-op thread): route
bytes per token per MoE layer, forward time of each variant interleaved round by round, and the
replay step alone. This module is the registered table: it runs :func:`.replay_measurements.measure`
in one gloo rank and writes the rows and notes (how to read them: docs/BENCHMARKS.md).
"""

import statistics

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.bench.replay_measurements import measure
from megatron_ext.bench.round_timing import paired_ratio
from megatron_ext.testing import run_distributed


def _step_rows(step_times: dict[str, list[float]], layers: int) -> list[list]:
    label = f"replay step alone, no model ({layers} layers' top-k + setup, per micro-batch): "
    names = {
        "native": "native top-k",
        "native_again": "native top-k again (control: the same code)",
        "megatron": "Megatron RouterReplay, targets precomputed per layer",
        "megatron_batch": "Megatron RouterReplay fed from the batch (users' glue)",
        "ours": "megatron_ext install() + replay",
    }
    rows = []
    for name, text in names.items():
        cells = _ratio_cells(step_times, name)
        cells[0] = round(statistics.median(step_times[name]), 4)  # tenths of a microsecond
        rows.append([label + text, "-", *cells])
    return rows


def _ratio_cells(times: dict[str, list[float]], name: str) -> list:
    vs_native = paired_ratio(times, name, "native")
    vs_megatron = paired_ratio(times, name, "megatron")
    return [
        round(statistics.median(times[name]), 2),
        round(vs_native["median"], 3),
        f"{vs_native['min']:.3f}..{vs_native['max']:.3f}",
        round(vs_megatron["median"], 3),
        f"{vs_megatron['min']:.3f}..{vs_megatron['max']:.3f}",
    ]


@register_benchmark("replay")
def replay(quick: bool) -> BenchResult:
    """Route bytes per token per layer and replay forward time vs native routing."""
    batch, seq, layers, rounds, inner = (2, 128, 2, 9, 2) if quick else (4, 512, 4, 15, 3)
    (r,) = run_distributed(measure, 1, batch, seq, layers, rounds, inner)
    vs_glue = paired_ratio(r["step_times"], "ours", "megatron_batch")
    return BenchResult(
        title="Route replay: bytes per token per MoE layer and forward time (top-2, 8 experts)",
        columns=[
            "path",
            "route bytes/token/layer",
            "ms (median)",
            "time vs native",
            "vs native min..max",
            "vs Megatron replay",
            "vs Megatron min..max",
        ],
        rows=_rows(r, layers),
        notes=_notes(batch, seq, layers, rounds, inner, vs_glue),
        extra={"times_ms": r["times"]},
    )


def _rows(r: dict, layers: int) -> list[list]:
    """The table's rows from :func:`.replay_measurements.measure`'s figures."""
    times, dash = r["times"], ["-"] * 5
    # Route bytes: our uint8 buffer (what is stored, read and copied host-to-device), Megatron's
    # RouterReplay targets as it records them (int64), Megatron inference's RoutingMetadata
    # dtype (int32), and what our binding keeps on the device per micro-batch (the uint8 rows and,
    # when it may have missing rows, the native policy's bool mask; the int64 copy a pass widens
    # them into is transient and not counted).
    return [
        ["native routing (no replay)", "-", *_ratio_cells(times, "native")],
        [
            "native routing again (control: the same code, timed as another variant)",
            "-",
            *_ratio_cells(times, "native_again"),
        ],
        ["Megatron RouterReplay (REPLAY_FORWARD)", r["megatron_bytes"]]
        + _ratio_cells(times, "megatron"),
        ["Megatron inference RoutingMetadata (int32)", r["inference_bytes"], *dash],
        ["megatron_ext route buffer (uint8, stored/H2D), no missing row (data's host count)"]
        + [r["ours_bytes"], *_ratio_cells(times, "ours")],
        ["megatron_ext, missing rows unknown (mask, native top-k, where per layer)"]
        + [r["ours_bytes"], *_ratio_cells(times, "ours_unknown")],
        [
            "megatron_ext install() alone (per micro-batch; share of a native forward)",
            "-",
            round(statistics.median(times["install"]), 3),
            round(paired_ratio(times, "install", "native")["median"], 4),
            *dash[:3],
        ],
        [
            "megatron_ext installed on device per micro-batch: rows (no missing row)",
            r["device_bytes"]["ours"],
            *dash,
        ],
        [
            "megatron_ext installed on device per micro-batch: rows + missing mask",
            r["device_bytes"]["ours_unknown"],
            *dash,
        ],
        *_step_rows(r["step_times"], layers),
        [
            "megatron_ext row index (once per shape; bytes/token, all layers)",
            r["index_bytes"],
            *dash,
        ],
    ]


def _notes(batch: int, seq: int, layers: int, rounds: int, inner: int, vs_glue: dict) -> str:
    """How the table was measured and how to read it (docs/BENCHMARKS.md prints it)."""
    return (
        f"Tiny MoE GPTModel on CPU (1 intra-op thread), B={batch}, S={seq}, {layers} MoE "
        f"layers, hidden 128. {rounds} interleaved rounds: every round runs the variants "
        f"{inner} times over in an order where each follows every other equally often and "
        "keeps each one's fastest call, timed in thread CPU time (other jobs on the shared "
        "cores do not count); "
        "ratios are the median over rounds of the paired per-round ratio, with its "
        "min..max. The 'again (control)' rows time native routing a second time as one more "
        "variant: their ratios are what identical code measures in this run, the scale "
        "against which to read the others. uint8 costs K = 2 bytes per token per layer; Megatron "
        "keeps int64 targets (8K) and its inference buffer is int32 (4K). Our forward "
        "includes install() (CP/SP slicing, one gather) and the int64 widening, once per "
        "pass for all the stage's layers (routers save their int64 slice for backward, as "
        "Megatron's targets are int64); with the "
        "dataset's host count saying a micro-batch has no missing row (has_missing=False) "
        "no mask, native top-k or where is computed; with the count unknown, the native "
        "policy adds a 1-byte bool mask per token per layer and the router's own top-k. "
        "'replay step alone': only what differs between the variants (the rest of a "
        "forward is the same work), per micro-batch, on fixed scores, interleaved the same "
        "way: every MoE layer's top-k call plus the per-micro-batch setup. Megatron's "
        "RouterReplay is given its targets precomputed (int64, sliced per layer), or fed "
        "from the same [B, S, L, K] batch by the glue its users write (router rows, one "
        "int64 copy per layer; without CP/SP slicing); ours is install() + the calls: "
        f"{vs_glue['median']:.3f}x ({vs_glue['min']:.3f}..{vs_glue['max']:.3f}) the fed "
        "Megatron step. On CPU a gather of 1-byte elements costs about 10 ns each, so the "
        "install's one gather is most of ours."
    )
