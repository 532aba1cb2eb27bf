"""Benchmark ``packing``: pad fraction and index build time, ours vs Megatron's, same documents.

One seeded SFT-like length distribution (log-normal, capacity 4096) written once as a real
IndexedDataset; Megatron's ``GPTDataset`` (no padding, documents cut at sample boundaries: the time
reference, built twice as a control), Megatron's SFT packing rule and our ``PackedDataset``
(``sequential``, ``best_fit``) all see exactly those documents. How to read the table is in its
notes (docs/BENCHMARKS.md).
"""

import os
import statistics
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.bench.rounds import design_length, round_order

SEQ_LENGTH = 4096
GPT_NAME = "Megatron GPTDataset (cuts documents)"
CONTROL_NAME = "Megatron GPTDataset again (control: the same build)"
SFT_NAME = "Megatron SFT rule (truncate overflow)"


def write_lengths_only(prefix: str, lens_D: np.ndarray) -> None:
    """An IndexedDataset with these document lengths: Megatron's ``.idx`` writer and a sparse
    ``.bin`` of the size it indexes (index builds read only the ``.idx``; 1M documents would be
    3.6 GB of tokens)."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    with _IndexWriter(prefix + ".idx", np.int32) as writer:
        writer.write(lens_D.astype(np.int32), None, np.arange(lens_D.size + 1))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lens_D.sum()) * np.dtype(np.int32).itemsize)


def sft_like_lengths(num_docs: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(6.3, 1.0, size=num_docs), 8, 3 * SEQ_LENGTH).astype(np.int64)


def megatron_sft_rule(lens_D: np.ndarray, capacity: int) -> tuple[int, int, int]:
    """Megatron SFT greedy packing over ``lens_D`` in order: (packs, real tokens, lost tokens)."""
    # SFTDataset.__getitem__'s rule (append conversations, truncate the one that overflows, pad to
    # pack_length), re-stated: SFTDataset itself packs inside one JSONL row and needs a chat
    # tokenizer.
    packs, real, lost, cur = 0, 0, 0, 0
    for n in lens_D.tolist():
        if cur + n >= capacity:  # Megatron: truncate on the right, then the pack is done
            take = capacity - cur
            real, lost, packs, cur = real + cur + take, lost + n - take, packs + 1, 0
        else:
            cur += n
    if cur:
        packs, real = packs + 1, real + cur
    return packs, real, lost


def _config(cls, prefix: str, cache: str, **kw):
    from megatron.core.tokenizers import MegatronTokenizer

    tok = MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null-text"}, vocab_size=50_000
    )
    return cls(
        random_seed=1,
        sequence_length=SEQ_LENGTH,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cache,
        **kw,
    )


def _timed(fn) -> tuple[object, float, float]:
    """``(fn(), wall seconds, CPU seconds of this process)``."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - t0, time.process_time() - c0


def _build(dataset_cls, config):
    """The train split built through Megatron's builder (a cache miss: a fresh cache path)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    return BlendedMegatronDatasetBuilder(dataset_cls, [None, 0, 0], lambda: True, config).build()[0]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _peak_mib(fn):
    """``(fn(), MiB)``: its result and the peak of traced allocations above those before it."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return result, (tracemalloc.get_traced_memory()[1] - base) / 2**20
    finally:
        tracemalloc.stop()


def _kernel_costs() -> tuple[float, float]:
    """Seconds to compile the pack kernel into an empty directory, and to load the result."""
    from megatron_ext.data import pack_kernel

    with tempfile.TemporaryDirectory() as cold:
        t0 = time.perf_counter()
        path = pack_kernel.compile_library(cold)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pack_kernel.load_library(path)
        return compile_s, time.perf_counter() - t0


def _methods(prefix: str, lens_D: np.ndarray, order: np.ndarray) -> dict[str, Any]:
    """``{method: build(cache directory)}``, each over the documents at ``prefix``."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig

    def gpt(cache: str):
        return _build(GPTDataset, _config(GPTDatasetConfig, prefix, cache))

    def sft_rule(cache: str):
        return megatron_sft_rule(lens_D[order], SEQ_LENGTH)

    def ours(algorithm: str):
        # Built through BlendedMegatronDatasetBuilder (a cache miss), planned by the compiled
        # loops of data/pack_kernel.py.
        def build(cache: str):
            cfg = _config(
                PackedDatasetConfig,
                prefix,
                cache,
                packing_algorithm=algorithm,
                pad_to_seq_len=True,
            )
            return _build(PackedDataset, cfg)

        return build

    return {
        GPT_NAME: gpt,
        CONTROL_NAME: gpt,  # timed as one more method: what identical code measures
        SFT_NAME: sft_rule,
        "ours: PackedDataset sequential": ours("sequential"),
        "ours: PackedDataset best_fit": ours("best_fit"),
    }


def _untimed_builds(methods: dict[str, Any], root: str) -> tuple[dict, dict, dict]:
    """Each method's warm-up build, then a build measured for peak memory and index bytes:
    ``(result, peak MiB, index bytes or None)`` by method."""
    names = list(methods)
    built, peak, index_bytes = {}, {}, {}
    for name, build in methods.items():
        build(os.path.join(root, "warmup", str(names.index(name))))
        cache = os.path.join(root, "memory", str(names.index(name)))
        built[name], peak[name] = _peak_mib(lambda b=build, c=cache: b(c))
        index_bytes[name] = _dir_bytes(cache) if os.path.isdir(cache) else None
    return built, peak, index_bytes


def _timed_rounds(
    methods: dict[str, Any], root: str, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each method's build, round after round."""
    names = list(methods)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        # Every method once per round, a fresh cache directory each, each method following every
        # other equally often: a ratio is then paired within a round.
        for name in round_order(names, r):
            cache = os.path.join(root, f"round{r}", str(names.index(name)))
            _, wall_s, cpu_s = _timed(lambda n=name, c=cache: methods[n](c))
            seconds[name].append(wall_s)
            cpu_seconds[name].append(cpu_s)
    return seconds, cpu_seconds


def _paired(times: dict[str, list[float]], name: str) -> list[float]:
    """Per round, ``name``'s time over GPTDataset's in the same round."""
    return [t / g for t, g in zip(times[name], times[GPT_NAME], strict=True)]


def _method_row(
    name: str,
    result: Any,
    total: int,
    seconds: dict[str, list[float]],
    cpu_seconds: dict[str, list[float]],
    index_bytes: int | None,
    peak_mib: float,
    num_docs: int,
) -> list:
    """One method's row of the table."""
    ratios = _paired(seconds, name)
    gpt_like = name in (GPT_NAME, CONTROL_NAME)
    if name == SFT_NAME:
        packs, real, lost = result
    else:
        packs, real = len(result), total
        if not gpt_like:  # ours: real tokens of the packs
            real = int(result.plan["piece_len_Q"].sum())
        lost = total - real
    pad = 0.0 if gpt_like else 1 - real / (packs * SEQ_LENGTH)
    return [
        name,
        packs,
        pad,
        lost / total,
        statistics.median(seconds[name]),
        statistics.median(ratios),
        min(ratios),
        max(ratios),
        statistics.median(_paired(cpu_seconds, name)),
        "-" if index_bytes is None else index_bytes / num_docs,
        peak_mib,
    ]


@register_benchmark("packing")
def packing(quick: bool) -> BenchResult:
    """Pad fraction, lost tokens, index build time, bytes and peak memory per packing method."""
    from megatron_ext.data import pack_kernel

    num_docs = 20_000 if quick else 1_000_000
    lens_D = sft_like_lengths(num_docs)
    total = int(lens_D.sum())
    order = np.random.default_rng(1).permutation(num_docs)
    compile_s, load_s = _kernel_costs()
    if pack_kernel.library() is None:  # compiles on a cold machine: before any timed build
        raise RuntimeError("the pack kernel did not compile; the figures would be the fallback's")
    with tempfile.TemporaryDirectory() as root:
        prefix = os.path.join(root, "docs")
        write_lengths_only(prefix, lens_D)
        methods = _methods(prefix, lens_D, order)
        # GPTDataset's build is short (about 0.05 s at 1M documents): a single wall-time round
        # of it is at the mercy of a shared machine, so the full run takes two whole designs.
        rounds = 5 if quick else 2 * design_length(len(methods))
        built, peak, index_bytes = _untimed_builds(methods, root)
        seconds, cpu_seconds = _timed_rounds(methods, root, rounds)
        rows = [
            _method_row(
                name, built[name], total, seconds, cpu_seconds, index_bytes[name], peak[name],
                num_docs,
            )
            for name in methods
        ]  # fmt: skip
        gpt_median = statistics.median(seconds[GPT_NAME])
        for label, cost in (
            ("ours: pack kernel compile (once per machine, cached)", compile_s),
            ("ours: pack kernel load (once per process)", load_s),
        ):
            rows.append([label, "-", "-", "-", cost, cost / gpt_median, "-", "-", "-", "-", "-"])
    return BenchResult(
        title=f"Packing: pad fraction and index build time ({num_docs} documents, seq {SEQ_LENGTH})",
        columns=[
            "method",
            "samples/packs",
            "pad fraction",
            "tokens lost",
            "index build s",
            "vs GPTDataset build",
            "ratio min",
            "ratio max",
            "CPU-time ratio",
            "index B/doc",
            "peak build MiB",
        ],
        rows=rows,
        notes=_notes(num_docs, total, rounds),
        extra={"seconds": seconds, "cpu_seconds": cpu_seconds, "num_docs": num_docs},
    )


def _notes(num_docs: int, total: int, rounds: int) -> str:
    """How the table was measured and how to read it."""
    return (
        f"{num_docs} documents, log-normal lengths (median ~545 tokens, clipped to 8..12288), "
        f"{total} tokens, one epoch, pad to seq_length {SEQ_LENGTH}. best_fit window 1000, "
        "over-long documents split (ours lose no tokens). Build times include writing the "
        "index cache (cache miss); the SFT rule is a Python loop over lengths only. "
        f"{rounds} rounds, methods interleaved (each following every other equally often); "
        "'index build s' and 'vs GPTDataset build' are medians, the ratio is paired per round "
        "(min and max beside it). The control row builds GPTDataset's index a second time as "
        "one more method: its ratio is what identical code measures in this run, the scale "
        "against which to read the others. 'CPU-time ratio' is the same median over this process's "
        "CPU time, "
        "which a busy machine disturbs less than wall time. Index B/doc: cache files / "
        "documents. Peak build MiB: tracemalloc peak "
        "of one untimed build (Megatron's C++ sample index, about 8 B per sample, is not "
        "traced). Kernel rows: compiling the pack kernel into an empty directory (once per "
        "machine and source version) and loading it (once per process that builds an "
        "index; a cache hit loads nothing), relative to the median GPTDataset build."
    )
