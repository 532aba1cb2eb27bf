"""Packing statistics of an IndexedDataset: pad fraction, pack-length histogram, over-long docs.

    python tools/pack_stats.py --data-path /data/sft --seq-length 4096 --png pack_stats.png
    python tools/pack_stats.py --data-path /data/sft --seq-length 4096 \\
        --packing-algorithm sequential --pad-to-multiple-of 8

The numbers are those of the first epoch of the training run's split: the documents of --split's
--split-name part (Megatron's own split arithmetic), shuffled with PackedDataset's epoch-0 random
stream (numpy default_rng((--seed, 0))), planned by the same planner
(megatron_ext.data.pack_planning). With the run's --seed, --split and packing flags they equal
what PackedDataset builds for one --data-path prefix (a blend packs each prefix on its own; later
epochs reshuffle, so their packs differ slightly).

--png / --json are checked before the work (an existing file is refused unless --overwrite, an
input never) and written through a temporary file. A setting that leaves no pack (every document
dropped by --pack-overlong-policy drop) is an error. Errors are one line, exit status 2; --debug
shows the traceback.
"""

import argparse
import json
import os
import sys

import numpy as np
from tqdm import tqdm

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import (
    INDEXED_EXTENSIONS,
    atomic_write_bytes,
    check_output_file,
    create_temp,
    put_in_place,
)
from megatron_ext.data.pack_planning import (
    OVERLONG_POLICIES,
    PACKING_ALGORITHMS,
    plan_packs,
)
from megatron_ext.data.padding import padded_lengths
from megatron_ext.data.tool_errors import add_common_flags, run_tool

SPLIT_NAMES = ("train", "valid", "test")


def split_documents(num_docs: int, split: str, split_name: str) -> np.ndarray:
    """Document indices of one split, as Megatron's ``BlendedMegatronDatasetBuilder`` cuts them.

    Example: ``split_documents(10, "80,10,10", "valid") -> [8]``.
    """
    # Megatron imported here, after megatron_ext.cli.quiet_tools (its import warns on a CPU machine).
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megatron_ext.training.eval_args import split_weights

    split_weights(split)  # Megatron's parser would read 0,0,0 or abc as NaN: say why first
    bookends = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    part = bookends[SPLIT_NAMES.index(split_name)]
    if part is None:
        raise ValueError(f"--split {split!r} gives the {split_name} split no documents")
    begin, end = (int(round(b * float(num_docs))) for b in part)
    return np.arange(begin, end, dtype=np.int64)


def histogram_edges(seq_length: int, max_bins: int = 10) -> np.ndarray:
    """At most ``max_bins`` integer bins over 0..seq_length, never empty or repeated edges.

    Example: ``histogram_edges(4) -> [0 1 2 3 4]``; ``histogram_edges(100) -> [0 10 ... 100]``.
    """
    return np.unique(np.linspace(0, seq_length, min(seq_length, max_bins) + 1).round().astype(int))


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-path", required=True, help="IndexedDataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--seq-length", type=int, required=True, help="pack capacity in tokens")
    p.add_argument("--packing-algorithm", choices=PACKING_ALGORITHMS, default="best_fit")
    p.add_argument("--packing-window", type=int, default=1000)
    p.add_argument("--pack-overlong-policy", choices=OVERLONG_POLICIES, default="split")
    p.add_argument("--pad-to-seq-len", action="store_true", help="pad every pack to --seq-length")
    p.add_argument("--pad-to-multiple-of", type=int, default=1)
    p.add_argument(
        "--seed", type=int, default=1234, help="the training run's --seed (document shuffle)"
    )
    p.add_argument(
        "--split", default="969,30,1", help="the training run's --split (Megatron's default)"
    )
    p.add_argument("--split-name", choices=SPLIT_NAMES, default="train", help="split to report")
    p.add_argument("--png", help="write a pack-length histogram here")
    p.add_argument("--json", help="write the statistics as JSON here")
    add_common_flags(p)
    return p


def pack_statistics(doc_lens_D: np.ndarray, args: argparse.Namespace) -> dict:
    """The numbers the tool reports: epoch 0 of the split, as PackedDataset plans it."""
    docs = split_documents(doc_lens_D.size, args.split, args.split_name)
    # PackedDataset._build_plan: rng = default_rng((seed, epoch)); docs = rng.permutation(...)
    order = np.random.default_rng((args.seed, 0)).permutation(docs)
    plan = plan_packs(
        doc_lens_D[order],
        args.seq_length,
        algorithm=args.packing_algorithm,
        window=args.packing_window,
        overlong=args.pack_overlong_policy,
    )
    real_P = plan.pack_lengths_P()
    padded_P = padded_lengths(
        real_P,
        seq_length=args.seq_length,
        pad_to_seq_len=args.pad_to_seq_len,
        pad_to_multiple_of=args.pad_to_multiple_of,
    )
    edges = histogram_edges(args.seq_length)
    hist, _ = np.histogram(real_P, bins=edges)
    return {
        "documents": int(docs.size),
        "packs": plan.num_packs,
        "real_tokens": int(real_P.sum()),
        "padded_tokens": int(padded_P.sum()),
        "pad_fraction": float(1 - real_P.sum() / max(padded_P.sum(), 1)),
        "mean_pack_length": float(real_P.mean()) if real_P.size else 0.0,
        "documents_split": plan.num_split,
        "documents_truncated": plan.num_truncated,
        "documents_dropped": plan.num_dropped,
        "documents_empty": plan.num_empty,
        "histogram_edges": edges.tolist(),
        "histogram_counts": hist.tolist(),
        "_pack_lengths": real_P,
    }


def main(argv: list[str] | None = None) -> int:
    """Prints (and optionally plots / dumps) the statistics; returns the exit status."""
    args = build_parser().parse_args(argv)
    # Megatron's IndexedDataset (its package imports torch) only once the flags parsed.
    from megatron_ext.data.indexed_checks import open_indexed

    if args.seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {args.seq_length}")
    if args.pad_to_multiple_of < 1:
        raise ValueError(f"--pad-to-multiple-of must be >= 1, got {args.pad_to_multiple_of}")
    if args.seed < 0:  # numpy's default_rng refuses it without naming the flag
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    dataset = open_indexed(args.data_path, "--data-path")  # alive: the lengths view its mmap
    # Before the work: a long run must not fail at its end on an unwritable --png / --json.
    inputs = [args.data_path + ext for ext in INDEXED_EXTENSIONS]
    outputs = [(flag, path) for flag, path in (("--png", args.png), ("--json", args.json)) if path]
    for flag, path in outputs:
        check_output_file(path, flag=flag, inputs=inputs, overwrite=args.overwrite)
    if args.png and args.json and os.path.abspath(args.png) == os.path.abspath(args.json):
        raise ValueError(f"--png and --json are the same file {args.png}")
    lens = np.array(dataset.sequence_lengths, dtype=np.int64)
    with tqdm(total=1, desc="planning packs") as bar:
        stats = pack_statistics(lens, args)
        bar.update()
    pack_lengths = stats.pop("_pack_lengths")
    if stats["packs"] == 0 and stats["documents"]:
        raise ValueError(
            f"no pack: all {stats['documents']} documents of the {args.split_name} split were "
            f"dropped ({stats['documents_dropped']} longer than --seq-length {args.seq_length} "
            f"with --pack-overlong-policy {args.pack_overlong_policy}, "
            f"{stats['documents_empty']} empty)"
        )
    for key, value in stats.items():
        if not key.startswith("histogram"):
            print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else f"{key:>22}: {value}")
    print("pack length histogram (real tokens):")
    edges, counts = stats["histogram_edges"], stats["histogram_counts"]
    top = max(counts, default=0) or 1
    for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True):
        print(f"  {lo:>7}-{hi:<7} {c:>8} {'#' * round(40 * c / top)}")
    if args.json:
        atomic_write_bytes(args.json, (json.dumps(stats, indent=2) + "\n").encode("utf-8"))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(pack_lengths, bins=edges, color="tab:blue")
        ax.set_xlabel("real tokens per pack")
        ax.set_ylabel("packs")
        ax.set_title(
            f"{args.packing_algorithm}: pad fraction {stats['pad_fraction']:.1%}, "
            f"{stats['packs']} packs"
        )
        fig.tight_layout()
        fd, tmp = create_temp(args.png)
        try:
            with os.fdopen(fd, "wb") as f:
                fig.savefig(f, dpi=100, format="png")
            put_in_place(tmp, args.png)  # never over a --png another run made meanwhile
        finally:
            plt.close(fig)
            if os.path.exists(tmp):
                os.unlink(tmp)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
