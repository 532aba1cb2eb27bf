"""Benchmark ``preprocess``: tokens per second of ``tools/preprocess_data.py``'s pipeline against
Megatron-LM's own script's, at 1 and 2 worker processes, on the same JSONL and tokenizer.

Megatron's side is its script's ``Pool.imap(encode, fin, 32)`` of one record at a time
(:mod:`.megatron_preprocess`); ours is :func:`~megatron_ext.data.jsonl_indexed.jsonl_to_indexed`
(chunks of records, one tokenizer call per chunk). Both write the same bytes (checked each run).
"""

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from megatron.core.datasets.indexed_dataset import DType

from megatron_ext.bench.megatron_preprocess import megatron_preprocess
from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.bench.round_timing import interleaved_rounds, paired_ratio
from megatron_ext.data.jsonl_documents import RecordFormat
from megatron_ext.data.jsonl_indexed import jsonl_to_indexed
from megatron_ext.data.text_tokenizers import TokenizerSpec, load_tokenizer

CORPUS = Path(__file__).resolve().parents[1] / "assets" / "corpus.jsonl"
WORKERS = (1, 2)


def tokenizer_dir(path: Path) -> Path:
    """A byte-level BPE (600 ids) trained on the embedded corpus, BOS before every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>")
    fast.save_pretrained(str(path))
    return path


def write_corpus(path: Path, size: int, seed: int = 0) -> None:
    """JSONL of ``size`` bytes or a little more: records of 1..8 corpus passages, joined at random
    (seeded)."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines()]
    rng = random.Random(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            text = " ".join(rng.choice(texts) for _ in range(rng.randint(1, 8)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line.encode())


@register_benchmark("preprocess")
def preprocess(quick: bool) -> BenchResult:
    """Tokens/s of our preprocessing vs Megatron's script's, at 1 and 2 workers."""
    # >= 50 MiB in the full run; the tokenizer is a Hugging Face directory trained on the embedded
    # corpus (byte-level BPE, 600 ids, BOS added by its post-processor).
    size = (256 << 10) if quick else (50 << 20)
    rounds = 2 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        tok_dir = tokenizer_dir(base / "tokenizer")
        src, small = base / "in.jsonl", base / "warm_up.jsonl"
        write_corpus(src, size)
        write_corpus(small, 64 << 10, seed=1)  # the warm-up pass: code and caches, not minutes
        counts: dict[str, int] = {}
        variants = _variants(base, src, small, tok_dir, counts)
        # Wall clock: the work is in several processes.
        times = interleaved_rounds(variants, rounds, clock=time.perf_counter)
        expected = (base / "megatron1_text_document.bin").read_bytes()
        for name in variants:
            got = (base / f"{name}_text_document.bin").read_bytes()
            assert got == expected, f"{name} wrote other bytes than Megatron's script"
        assert len(set(counts.values())) == 1
        tokens = counts["megatron1"]
        rows = [_row(times, tokens, w) for w in WORKERS]
    return BenchResult(
        title="Preprocessing throughput: tools/preprocess_data.py vs Megatron-LM's script",
        columns=[
            "workers",
            "Megatron tokens/s",
            "ours tokens/s",
            "ours/Megatron speed (median)",
            "min",
            "max",
        ],
        rows=rows,
        notes=(
            f"{size / 2**20:g} MiB of JSONL ({tokens} tokens, {os.cpu_count()} CPUs), {rounds} "
            "interleaved rounds, wall clock; speed ratio = Megatron's time / ours in the same "
            "round (median, min, max over rounds); both outputs byte-identical (checked). The warm-up "
            "pass runs on 64 KiB."
        ),
    )


def _variants(base: Path, src: Path, small: Path, tok_dir: Path, counts: dict[str, int]) -> dict:
    """``{name: run()}``, Megatron's script and ours at each worker count. A variant's first run
    is the warm-up on ``small``; each run records its token count in ``counts``."""
    tokenizer_argv = ["--tokenizer-type", "HuggingFaceTokenizer"]
    tokenizer_argv += ["--tokenizer-model", str(tok_dir)]
    spec = TokenizerSpec(str(tok_dir))
    tok = load_tokenizer(spec)
    dtype = DType.optimal_dtype(tok.vocab_size)
    fmt = RecordFormat(keys=("text",), eod_id=tok.eos_id, dtype=dtype.__name__)

    def megatron(workers: int):
        def run() -> None:
            name = f"megatron{workers}"
            counts[name] = megatron_preprocess(
                str(src if name in counts else small),
                str(base / name),
                tokenizer_argv,
                ["text"],
                True,
                workers,
            )

        return run

    def ours(workers: int):
        def run() -> None:
            name = f"ours{workers}"
            _, tokens = jsonl_to_indexed(
                str(src if name in counts else small),
                spec,
                fmt,
                [str(base / f"{name}_text_document")],
                dtype,
                workers=workers,
            )
            counts[name] = tokens[0]

        return run

    variants = {}
    for w in WORKERS:
        variants[f"megatron{w}"] = megatron(w)
        variants[f"ours{w}"] = ours(w)
    return variants


def _row(times: dict[str, list[float]], tokens: int, workers: int) -> list:
    """Tokens/s of both at ``workers``, and the paired speed ratio (above 1: ours is faster)."""
    speed = paired_ratio(times, f"megatron{workers}", f"ours{workers}")  # Megatron's time / ours
    return [
        workers,
        tokens / statistics.median(times[f"megatron{workers}"]) * 1e3,
        tokens / statistics.median(times[f"ours{workers}"]) * 1e3,
        speed["median"],
        speed["min"],
        speed["max"],
    ]
