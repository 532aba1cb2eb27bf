"""Benchmark ``packing``: pad fraction and index build time, ours vs Megatron's, same documents.

One seeded SFT-like length distribution (log-normal, capacity 4096) written once as a real
IndexedDataset; every method sees exactly those documents:

- Megatron ``GPTDataset``: no padding, but documents are concatenated and cut at sample
  boundaries (cross-document samples); its index build time is the reference. Built a second
  time as a control method: its ratio is what identical code measures in the run.
- Megatron's SFT packing rule (``SFTDataset.__getitem__``: append conversations, truncate the one
  that overflows, pad to ``pack_length``), applied over the same lengths in order. SFTDataset
  itself packs inside one JSONL row and needs a chat tokenizer, so the rule is re-stated here.
- ours: :class:`~megatron_ext.data.packed_dataset.PackedDataset` with ``sequential`` and
  ``best_fit`` packing, built through ``BlendedMegatronDatasetBuilder`` (cache miss), planned by
  the compiled loops of :mod:`~megatron_ext.data.pack_kernel`, whose one-time compile and
  per-process load are timed as rows of their own.

Method: every round builds every method once (a fresh cache directory each, in an order where each
method follows every other equally often: :mod:`.rounds`), and a method's ratio is the median over
rounds of its time / GPTDataset's time *in the same round*, with the min and max. Index bytes per
document are the cache files' size; peak build memory is the peak of traced allocations (numpy and
Python, ``tracemalloc``) in an untimed build before the rounds, after an untimed warm-up build of
every method.
"""

import os
import statistics
import tempfile
import time
import tracemalloc

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


@register_benchmark("packing")
def packing(quick: bool) -> BenchResult:
    """Pad fraction, lost tokens, index build time, bytes and peak memory per packing method."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_ext.data import pack_kernel
    from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig

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

        def gpt(cache: str):
            return _build(GPTDataset, _config(GPTDatasetConfig, prefix, cache))

        def sft_rule(cache: str):
            return megatron_sft_rule(lens_D[order], SEQ_LENGTH)

        def ours(algorithm: str):
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

        methods = {
            GPT_NAME: gpt,
            CONTROL_NAME: gpt,  # timed as one more method: what identical code measures
            SFT_NAME: sft_rule,
            "ours: PackedDataset sequential": ours("sequential"),
            "ours: PackedDataset best_fit": ours("best_fit"),
        }
        names = list(methods)
        # GPTDataset's build is short (about 0.05 s at 1M documents): a single wall-time round
        # of it is at the mercy of a shared machine, so the full run takes two whole designs.
        rounds = 5 if quick else 2 * design_length(len(names))
        built, peak, index_bytes = {}, {}, {}
        for name, build in methods.items():  # untimed: warm up, then memory and bytes
            build(os.path.join(root, "warmup", str(names.index(name))))
            cache = os.path.join(root, "memory", str(names.index(name)))
            built[name], peak[name] = _peak_mib(lambda b=build, c=cache: b(c))
            index_bytes[name] = _dir_bytes(cache) if os.path.isdir(cache) else None
        seconds = {name: [] for name in names}
        cpu_seconds = {name: [] for name in names}
        for r in range(rounds):
            for name in round_order(names, r):
                cache = os.path.join(root, f"round{r}", str(names.index(name)))
                _, wall_s, cpu_s = _timed(lambda n=name, c=cache: methods[n](c))
                seconds[name].append(wall_s)
                cpu_seconds[name].append(cpu_s)

        def paired(times: dict[str, list[float]], name: str) -> list[float]:
            return [t / g for t, g in zip(times[name], times[GPT_NAME], strict=True)]

        rows: list[list] = []
        for name in names:
            ratios = paired(seconds, name)
            result = built[name]
            gpt_like = name in (GPT_NAME, CONTROL_NAME)
            if name == SFT_NAME:
                packs, real, lost = result
            else:
                packs, real = len(result), total
                if not gpt_like:  # ours: real tokens of the packs
                    real = int(result.plan["piece_len_Q"].sum())
                lost = total - real
            pad = 0.0 if gpt_like else 1 - real / (packs * SEQ_LENGTH)
            b = index_bytes[name]
            rows.append(
                [
                    name,
                    packs,
                    pad,
                    lost / total,
                    statistics.median(seconds[name]),
                    statistics.median(ratios),
                    min(ratios),
                    max(ratios),
                    statistics.median(paired(cpu_seconds, name)),
                    "-" if b is None else b / num_docs,
                    peak[name],
                ]
            )
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
        notes=(
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
        ),
        extra={"seconds": seconds, "cpu_seconds": cpu_seconds, "num_docs": num_docs},
    )
