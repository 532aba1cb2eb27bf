"""tools/merge_datasets.py writes what Megatron-LM's tools/merge_datasets.py writes.

Tier: Megatron on one rank (Megatron-Core 0.19.2's IndexedDataset and IndexedDatasetBuilder; the
tool in-process). The expected file is built by :func:`megatron_merge`, which drives Megatron's
installed classes as Megatron-LM's script does (tools/merge_datasets.py at NVIDIA/Megatron-LM
commit 00caa53af30912914981c86f39db123961678bbd, ``main``: the directory's prefixes sorted, a
builder with the first shard's ``index.dtype``, ``add_index`` per shard, ``finalize``); the
script is not in the megatron-core wheel: it was read, not copied.
"""

import os
import re
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

TOOL = Path(__file__).resolve().parents[2] / "tools" / "merge_datasets.py"


def megatron_merge(directory: Path, output_prefix: str) -> None:
    prefixes = sorted({os.path.splitext(name)[0] for name in os.listdir(directory)})
    builder = None
    for prefix in prefixes:
        if builder is None:
            dataset = IndexedDataset(str(directory / prefix))
            builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=dataset.index.dtype)
            del dataset
        builder.add_index(str(directory / prefix))
    builder.finalize(output_prefix + ".idx")


def shard(path: Path, docs: list[list[list[int]]], dtype=np.uint16) -> None:
    """A shard written by Megatron's builder: documents of sequences (``[]``: an empty one)."""
    builder = IndexedDatasetBuilder(str(path) + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    builder.finalize(str(path) + ".idx")


def load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("merge_datasets", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def files(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture
def shards(tmp_path) -> Path:
    d = tmp_path / "shards"
    d.mkdir()
    shard(d / "b", [[[5, 6], [7]], [], [[8]]])  # named b: merged after a (name order)
    shard(d / "a", [[[1, 2, 3]], [[4]]])
    shard(d / "c", [[], [[9, 10]]])
    return d


def test_merge_is_megatrons_byte_for_byte(shards, tmp_path, monkeypatch) -> None:
    # Megatron's add_index calls gc.collect() per shard (0.3 to 0.5 s each with torch loaded);
    # the bytes written do not depend on it.
    monkeypatch.setattr("gc.collect", lambda *args: 0)
    megatron_merge(shards, str(tmp_path / "megatron"))
    argv = ["--input", str(shards), "--output-prefix", str(tmp_path / "ours")]
    assert load_tool().main(argv) == 0
    assert files(tmp_path / "ours") == files(tmp_path / "megatron")
    ds = IndexedDataset(str(tmp_path / "ours"))  # a's, b's, then c's documents
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4], [5, 6], [7], [8], [9, 10]]
    assert ds.document_indices.tolist() == [0, 1, 2, 4, 4, 5, 5, 6]
    # The given order with --input-prefixes.
    order = [str(shards / n) for n in ("c", "a")]
    assert (
        load_tool().main(["--input-prefixes", *order, "--output-prefix", str(tmp_path / "ca")]) == 0
    )
    assert IndexedDataset(str(tmp_path / "ca")).document_indices.tolist() == [0, 0, 1, 2, 3]


def test_shards_preprocessed_in_parts_merge_to_the_whole(tmp_path, monkeypatch) -> None:
    """preprocess_data.py on two halves of a JSONL, merged, equals it on the whole."""
    monkeypatch.setattr("gc.collect", lambda *args: 0)  # Megatron's add_index: per shard, slow
    from tests.tools.test_preprocess_data import load_tool as preprocess

    rows = [f'{{"text": "{t}"}}' for t in ("ab", "", "cde", "f")]
    d = tmp_path / "parts"
    d.mkdir()
    for name, part in (("whole", rows), ("p0", rows[:2]), ("p1", rows[2:])):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("\n".join(part) + "\n")
        out = str((tmp_path if name == "whole" else d) / name)
        assert preprocess().main(["--input", str(src), "--output-prefix", out, "--append-eod"]) == 0
    assert load_tool().main(["--input", str(d), "--output-prefix", str(tmp_path / "m")]) == 0
    assert files(tmp_path / "m") == files(tmp_path / "whole")


def run(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from megatron_ext.data.tool_errors import run_tool

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_tool(load_tool().main, argv)
    return rc, err.getvalue()


def test_bad_shards_are_one_line_errors_and_nothing_is_written(shards, tmp_path) -> None:
    out = ["--output-prefix", str(tmp_path / "o")]
    shard(shards / "d_loss_mask", [[[1, 0]]], dtype=np.uint8)
    rc, err = run(["--input", str(shards), *out])
    assert rc == 2 and err.count("\n") == 1, err
    assert re.search(r"d_loss_mask\.idx holds uint8 but .*a\.idx holds uint16", err), err
    os.unlink(shards / "d_loss_mask.idx")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "old.bin").write_text("keep")
    cases = [
        (["--input", str(shards), *out], r"d_loss_mask\.bin has no d_loss_mask\.idx beside it"),
        (["--input", str(empty), *out], "holds no .bin/.idx pair"),
        (["--input", str(tmp_path / "file"), *out], "is not a directory"),
        (["--input-prefixes", str(tmp_path / "nope"), *out], r"nope\.idx does not exist"),
        (
            ["--input-prefixes", str(shards / "a"), "--output-prefix", str(tmp_path / "old")],
            "already exists",
        ),
        (
            [
                "--input-prefixes",
                str(shards / "a"),
                "--output-prefix",
                str(shards / "a"),
                "--overwrite",
            ],
            "is an input",
        ),
    ]
    for argv, match in cases:
        rc, err = run(argv)
        assert rc == 2 and err.count("\n") == 1 and re.search(match, err), (argv, err)
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.bin").exists()
    assert (tmp_path / "old.bin").read_text() == "keep"
    # A truncated shard: refused by size, before the output is opened.
    os.unlink(shards / "d_loss_mask.bin")
    with open(shards / "b.bin", "r+b") as f:
        f.truncate(4)
    rc, err = run(["--input", str(shards), *out])
    assert rc == 2 and "truncated" in err and not (tmp_path / "o.idx").exists(), err


def test_a_shard_named_twice_is_refused_naming_both(shards, tmp_path) -> None:
    """The same shard by the same prefix, a symlink or a hard link (one file: same st_dev and
    st_ino) would be merged twice. Megatron's script has no --input-prefixes; its --input
    directory repeats a shard through a symlinked pair, which it merges twice (differing on
    purpose: docs/data.md)."""
    a = str(shards / "a")
    links = tmp_path / "links"
    links.mkdir()
    for ext in (".bin", ".idx"):
        os.symlink(a + ext, links / f"sym{ext}")
        os.link(a + ext, links / f"hard{ext}")
    out = ["--output-prefix", str(tmp_path / "o")]
    cases = [
        ([a, a], rf"--input-prefixes: {a} is given twice; merging it twice would repeat"),
        ([a, str(links / "sym")], rf"{a} and {links}/sym are the same shard \({a}\.bin and "),
        ([str(links / "hard"), str(shards / "b"), a], rf"{links}/hard and {a} are the same shard"),
    ]
    for prefixes, match in cases:
        rc, err = run(["--input-prefixes", *prefixes, *out])
        assert rc == 2 and err.count("\n") == 1 and re.search(match, err), (prefixes, err)
    os.symlink(a + ".bin", shards / "z.bin")  # a directory holding a's pair twice
    os.symlink(a + ".idx", shards / "z.idx")
    rc, err = run(["--input", str(shards), *out])
    assert rc == 2 and re.search(rf"--input: {a} and {shards}/z are the same shard", err), err
    assert not os.path.exists(tmp_path / "o.bin") and not os.path.exists(tmp_path / "o.idx")


# Megatron's reader, half-built on the empty first shard, fails again in its __del__.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_empty_shard_adds_nothing_as_in_megatrons_merge(tmp_path, monkeypatch) -> None:
    """Megatron's add_index reads a shard's .idx and copies its .bin, so an empty shard (no
    token: an empty .bin) after the first merges and adds nothing; only the first shard is opened
    by IndexedDataset, which cannot map an empty .bin (tools/merge_datasets.py at NVIDIA/Megatron-LM
    commit 00caa53af30912914981c86f39db123961678bbd, ``main``; megatron-core 0.19.2's
    IndexedDatasetBuilder.add_index). Ours merges an empty shard wherever it falls."""
    # Megatron's add_index calls gc.collect() per shard (0.3 to 0.5 s each with torch loaded, 9
    # calls here); the bytes written do not depend on it.
    monkeypatch.setattr("gc.collect", lambda *args: 0)
    d = tmp_path / "shards"
    d.mkdir()
    shard(d / "a", [[[1, 2, 3]], [[4]]])
    shard(d / "b_empty", [])
    shard(d / "c_empty_docs", [[[]], [[], []]])  # documents of empty sequences only
    assert os.path.getsize(d / "b_empty.bin") == os.path.getsize(d / "c_empty_docs.bin") == 0
    megatron_merge(d, str(tmp_path / "megatron"))
    assert load_tool().main(["--input", str(d), "--output-prefix", str(tmp_path / "ours")]) == 0
    assert files(tmp_path / "ours") == files(tmp_path / "megatron")
    ds = IndexedDataset(str(tmp_path / "ours"))  # c_empty_docs' documents kept, as Megatron's
    assert ds.sequence_lengths.tolist() == [3, 1, 0, 0, 0]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 5]
    # First in the order: Megatron's merge cannot map it; ours merges it (it adds nothing).
    os.rename(d / "b_empty.bin", d / "0_empty.bin")
    os.rename(d / "b_empty.idx", d / "0_empty.idx")
    with pytest.raises(ValueError, match="cannot mmap an empty file"):
        megatron_merge(d, str(tmp_path / "megatron_first"))
    assert load_tool().main(["--input", str(d), "--output-prefix", str(tmp_path / "first")]) == 0
    assert files(tmp_path / "first") == files(tmp_path / "ours")
    # Only empty shards: no token to write, refused in one line.
    argv = ["--input-prefixes", str(d / "0_empty"), "--output-prefix", str(tmp_path / "none")]
    rc, err = run(argv)
    assert rc == 2 and err.count("\n") == 1 and "every shard's .bin is empty" in err, err
    assert not os.path.exists(tmp_path / "none.bin")
