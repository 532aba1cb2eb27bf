"""Round-trip tests for tools/pack_stats.py. Tier: Megatron on one rank (IndexedDataset files;
the tool runs in-process via its main())."""

import importlib.util
import json
import os

import numpy as np
import pytest

from megatron_ext.data.indexed_writer import write_documents
from tests.data.dataset_helpers import edit_index, megatron_pair

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "pack_stats.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("pack_stats", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hand_worked_stats_json_and_png(tmp_path, capsys) -> None:
    prefix = str(tmp_path / "d")
    # Lengths 5, 6, 3, 2, 12 at capacity 8: 12 is split into 8 + 4. Best fit (window 10):
    # 8 | 6 2 | 5 3 | 4 -> real 8, 8, 8, 4 = 28 tokens in 4 packs of 8: pad 4 / 32.
    write_documents(prefix, [np.ones(n) for n in (5, 6, 3, 2, 12)])
    out = str(tmp_path / "s.json")
    png = str(tmp_path / "s.png")
    argv = [
        "--data-path",
        prefix,
        "--seq-length",
        "8",
        "--pad-to-seq-len",
        "--packing-window",
        "10",
        "--json",
        out,
        "--png",
        png,
    ]
    assert load_tool().main(argv) == 0
    with open(out) as f:
        stats = json.load(f)
    assert stats["packs"] == 4 and stats["real_tokens"] == 28 and stats["padded_tokens"] == 32
    assert stats["pad_fraction"] == pytest.approx(4 / 32)
    assert stats["documents_split"] == 1 and sum(stats["histogram_counts"]) == 4
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "pad_fraction: 0.1250" in printed and "pack length histogram" in printed


def test_sequential_pads_more_than_best_fit(tmp_path) -> None:
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    write_documents(prefix, [np.ones(int(n)) for n in rng.integers(1, 64, size=300)])
    fractions = {}
    for algorithm in ("sequential", "best_fit"):
        out = str(tmp_path / f"{algorithm}.json")
        load_tool().main(
            [
                "--data-path",
                prefix,
                "--seq-length",
                "64",
                "--pad-to-seq-len",
                "--packing-algorithm",
                algorithm,
                "--json",
                out,
            ]
        )
        with open(out) as f:
            fractions[algorithm] = json.load(f)["pad_fraction"]
    assert fractions["best_fit"] < fractions["sequential"]


def test_bad_inputs(tmp_path) -> None:
    tool = load_tool()
    with pytest.raises(ValueError, match=r"--data-path file .*missing\.idx does not exist"):
        tool.main(["--data-path", str(tmp_path / "missing"), "--seq-length", "8"])
    write_documents(str(tmp_path / "d"), [np.ones(3)])
    with pytest.raises(ValueError, match="--seq-length must be >= 1"):
        tool.main(["--data-path", str(tmp_path / "d"), "--seq-length", "0"])
    with pytest.raises(ValueError, match="--seq-length=8 is not a multiple of --pad-to-multiple"):
        tool.main(
            [
                "--data-path",
                str(tmp_path / "d"),
                "--seq-length",
                "8",
                "--pad-to-multiple-of",
                "3",
            ]
        )


def document_lengths(prefix: str) -> np.ndarray:
    """Document lengths as the tool reads them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # keep it alive while copying: the lengths view its mmap
    return np.array(dataset.sequence_lengths, dtype=np.int64)


def test_seq_length_below_ten_bins(tmp_path) -> None:
    # linspace(0, 4, 11).astype(int) repeats edges, which numpy's histogram refuses.
    prefix = str(tmp_path / "d")
    write_documents(prefix, [np.ones(n) for n in (1, 2, 3, 4, 5)])
    out = str(tmp_path / "s.json")
    assert load_tool().main(["--data-path", prefix, "--seq-length", "4", "--json", out]) == 0
    with open(out) as f:
        stats = json.load(f)
    assert stats["histogram_edges"] == [0, 1, 2, 3, 4]
    assert sum(stats["histogram_counts"]) == stats["packs"] > 0
    assert load_tool().histogram_edges(1).tolist() == [0, 1]
    assert load_tool().histogram_edges(100).tolist() == list(range(0, 101, 10))


@pytest.mark.parametrize("algorithm, split_name", [("best_fit", "train"), ("sequential", "valid")])
def test_numbers_equal_the_packed_datasets_first_epoch(
    tmp_path, algorithm: str, split_name: str
) -> None:
    from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig
    from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(3)
    write_documents(prefix, [np.ones(int(n)) for n in rng.integers(1, 70, size=200)])
    seed, split, seq = 11, "70,30,0", 48
    out = str(tmp_path / "s.json")
    flags = ["--seed", str(seed), "--split", split, "--split-name", split_name]
    flags += ["--packing-algorithm", algorithm, "--packing-window", "16", "--json", out]
    argv = ["--data-path", prefix, "--seq-length", str(seq), *flags]
    tool = load_tool()
    assert tool.main(argv) == 0
    with open(out) as f:
        stats = json.load(f)
    lens_D = document_lengths(prefix)
    tool_packs = tool.pack_statistics(lens_D, tool.build_parser().parse_args(argv))["_pack_lengths"]
    config = PackedDatasetConfig(
        **gpt_config_kwargs(
            [prefix],
            sequence_length=seq,
            random_seed=seed,
            split=split,
            path_to_cache=str(tmp_path / "c"),
        ),
        packing_algorithm=algorithm,
        packing_window=16,
    )
    ds = build_splits(PackedDataset, config, [None, None, None])[
        ("train", "valid").index(split_name)
    ]
    lens_P = np.diff(ds.plan["pack_offsets_P1"])
    pack_lengths = np.add.reduceat(ds.plan["piece_len_Q"], ds.plan["pack_offsets_P1"][:-1])
    assert stats["packs"] == len(ds) == lens_P.size and stats["documents"] == ds.indices.size
    assert stats["real_tokens"] == int(pack_lengths.sum())
    assert stats["documents_split"] == ds.stats["num_split"] > 0  # over-long docs occurred
    # The same packs (order aside: best_fit shuffles packs after planning).
    assert sorted(tool_packs.tolist()) == sorted(pack_lengths.tolist())
    hist, _ = np.histogram(pack_lengths, bins=stats["histogram_edges"])
    assert stats["histogram_counts"] == hist.tolist()


def run_cli(argv: list[str]) -> tuple[int, str]:
    """The tool as a user runs it: one line on stderr and exit status 2 for a user error."""
    import contextlib
    import io

    from megatron_ext.data.tool_errors import run_tool

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_tool(load_tool().main, argv)
    return rc, err.getvalue()


#: (case, extra flags, expected one-line message); data: "{tmp}/d" = 2 documents of 5 and 12.
BAD_INPUTS = [
    ("missing data", ["--data-path", "{tmp}/nope"], r"--data-path file .*nope\.idx does not"),
    ("truncated .bin", ["--data-path", "{tmp}/cut"], r"cut\.bin has 4 bytes but .*cut\.idx"),
    (  # another corpus's .idx (same counts, so the same size) beside d.bin: int32 5 + 12 != 6 + 10
        "foreign .idx",
        ["--data-path", "{tmp}/foreign"],
        r"foreign\.bin has 68 bytes but .*foreign\.idx indexes 64 .* or the \.idx is another",
    ),
    (  # d.idx with its two lengths swapped in place: same size and total, pointers disagree
        ".idx not its .bin's",
        ["--data-path", "{tmp}/swapped"],
        r"swapped\.idx does not describe .*swapped\.bin: its sequence 1 starts at byte 20 but",
    ),
    ("--seq-length 0", ["--seq-length", "0"], "--seq-length must be >= 1"),
    ("--pad-to-multiple-of 0", ["--pad-to-multiple-of", "0"], "--pad-to-multiple-of must be"),
    (
        "all dropped",
        ["--seq-length", "4", "--pack-overlong-policy", "drop"],
        r"no pack: all 2 documents of the train split were dropped \(2 longer",
    ),
    ("--json over the .idx", ["--json", "{tmp}/d.idx"], r"d\.idx is an input"),
    ("existing --png", ["--png", "{tmp}/old.png"], r"old\.png already exists; pass --overwrite"),
    ("--png under a file", ["--png", "{tmp}/d.bin/x.png"], "is a file, not a directory"),
    ("--json is a directory", ["--json", "{tmp}", "--overwrite"], "is a directory"),
    ("--seed -1", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("--split 0,0,0", ["--split", "0,0,0"], "--split 0,0,0: weights must be finite"),
    ("--split abc", ["--split", "abc"], "--split abc: weights must be numbers"),
    ("--split 1,1,1,1", ["--split", "1,1,1,1"], "--split 1,1,1,1: at most three weights"),
]


@pytest.mark.parametrize(
    "extra, match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_give_one_line_errors_before_the_work(tmp_path, extra, match) -> None:
    write_documents(str(tmp_path / "d"), [np.ones(5), np.ones(12)])
    write_documents(str(tmp_path / "cut"), [np.ones(5)])
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(4)
    megatron_pair(tmp_path / "other", [6, 10], [1, 1], np.int32)
    for name, idx in (("foreign", "other"), ("swapped", "d")):
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "d.bin").read_bytes())
        (tmp_path / f"{name}.idx").write_bytes((tmp_path / f"{idx}.idx").read_bytes())
    edit_index(tmp_path / "swapped", "lengths", [12, 5])
    (tmp_path / "old.png").write_bytes(b"keep me")
    argv = ["--data-path", str(tmp_path / "d"), "--seq-length", "16"]
    argv += [a.replace("{tmp}", str(tmp_path)) for a in extra]
    rc, err = run_cli(argv)
    errors = [line for line in err.splitlines() if "error" in line]  # besides the progress bar
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("error: ") and __import__("re").search(match, errors[0]), err
    assert (tmp_path / "old.png").read_bytes() == b"keep me"
    with pytest.raises(ValueError, match=match):
        run_cli([*argv, "--debug"])
