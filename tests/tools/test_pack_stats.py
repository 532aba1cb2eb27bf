"""Round-trip tests for tools/pack_stats.py. Tier: Megatron on one rank (IndexedDataset files;
the tool runs in-process via its main())."""

import importlib.util
import json
import os

import numpy as np
import pytest

from megatron_ext.data.indexed_writer import write_documents

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
    assert (
        stats["packs"] == 4
        and stats["real_tokens"] == 28
        and stats["padded_tokens"] == 32
    )
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
    with pytest.raises(
        ValueError, match=r"--data-path file .*missing\.idx does not exist"
    ):
        tool.main(["--data-path", str(tmp_path / "missing"), "--seq-length", "8"])
    write_documents(str(tmp_path / "d"), [np.ones(3)])
    with pytest.raises(ValueError, match="--seq-length must be >= 1"):
        tool.main(["--data-path", str(tmp_path / "d"), "--seq-length", "0"])
    with pytest.raises(
        ValueError, match="--seq-length=8 is not a multiple of --pad-to-multiple"
    ):
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
