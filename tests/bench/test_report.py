"""Tier: pure (report writing) and gloo ranks (the hot-spot benchmark, quick size)."""

import argparse
import json

import pytest

from megatron_ext.bench import report
from megatron_ext.bench.registry import BENCHMARKS, BenchResult, discover, register_benchmark


def test_rows_must_match_columns() -> None:
    with pytest.raises(ValueError, match="does not match columns"):
        BenchResult(title="t", columns=["a", "b"], rows=[[1]])


def test_duplicate_registration_is_refused() -> None:
    discover()
    name = next(iter(BENCHMARKS))
    with pytest.raises(ValueError, match="registered twice"):
        register_benchmark(name)(lambda quick: None)


def test_markdown_and_json_carry_date_machine_command_and_values(tmp_path, monkeypatch) -> None:
    @register_benchmark("_toy_for_report_test")
    def toy(quick: bool) -> BenchResult:
        second = BenchResult(title="Second", columns=["layer", "ms"], rows=[["y", 7.5]], notes="m")
        return BenchResult(
            title="Toy", columns=["case", "ratio"], rows=[["x", 1.25]], notes="n", tables=[second]
        )

    try:
        monkeypatch.setattr("sys.argv", ["megatron-ext", "bench", "--only", "_toy_for_report_test"])
        md, js = tmp_path / "B.md", tmp_path / "b.json"
        args = argparse.Namespace(
            only=["_toy_for_report_test"], quick=True, markdown=str(md), json=str(js)
        )
        assert report.main(args) == 0
        text = md.read_text()
        for needle in (
            "- date:",
            "- machine:",
            "command: `megatron-ext bench --only",
            "| x | 1.25 |",
        ):
            assert needle in text
        # A second table renders under the first, with its own heading, rows and notes.
        assert text.index("| x | 1.25 |") < text.index("### Second") < text.index("| y | 7.5 |")
        assert "\nm\n" in text
        data = json.loads(js.read_text())
        assert data["benchmarks"]["_toy_for_report_test"]["rows"] == [["x", 1.25]]
        assert data["benchmarks"]["_toy_for_report_test"]["tables"][0]["rows"] == [["y", 7.5]]
        # A second run refuses to replace them unless told (before running anything).
        ran = []
        BENCHMARKS["_toy_for_report_test"] = lambda quick: ran.append(1) or toy(quick)
        with pytest.raises(ValueError, match=r"--markdown .*B\.md already exists; pass --overw"):
            report.main(args)
        assert ran == [] and md.read_text() == text
        args.overwrite = True
        assert report.main(args) == 0 and ran == [1]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["B.md", "b.json"]  # no temp left
    finally:
        BENCHMARKS.pop("_toy_for_report_test")


def test_unknown_benchmark_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="--only: unknown benchmark"):
        report.run_benchmarks(["no_such_bench"], quick=True)


def test_hot_spot_ratios_are_computed_from_the_same_run() -> None:
    from megatron_ext.bench.hot_spot import hot_spot

    result = hot_spot(quick=True)
    rows = {row[0]: row for row in result.rows}
    assert set(rows) == {"no padding", "constant id", "self tokens"}
    base = rows["no padding"]
    for row in rows.values():
        assert row[2] == pytest.approx(row[1] / base[1])
        assert row[4] == pytest.approx(row[3] / base[3])
    # The interesting case occurred: constant pads skew the EP-rank load more than self pads.
    assert rows["constant id"][1] > rows["self tokens"][1]
    # Raw counts are kept: every routed slot is accounted for (tokens x top-2 x ranks).
    per_rank = result.extra["constant id"]["per_rank"]
    assert all(sum(layer) == 2 * 4 * 128 * 2 for layer in per_rank)


def test_update_merges_one_benchmark_into_the_existing_report(tmp_path, monkeypatch) -> None:
    values = {"a": 1.5, "b": 2.5}

    def make(name: str):
        return lambda quick: BenchResult(title=name.upper(), columns=["v"], rows=[[values[name]]])

    names = ["_toy_update_a", "_toy_update_b"]
    for name, key in zip(names, "ab", strict=True):
        register_benchmark(name)(make(key))
    try:
        md, js = tmp_path / "B.md", tmp_path / "b.json"
        args = argparse.Namespace(only=names, quick=True, markdown=str(md), json=str(js))
        monkeypatch.setattr("sys.argv", ["megatron-ext", "bench", "--only", *names])
        assert report.main(args) == 0
        first = json.loads(js.read_text())
        values["b"] = 9.0
        monkeypatch.setattr("sys.argv", ["megatron-ext", "bench", "--only", names[1], "--update"])
        update = argparse.Namespace(
            only=[names[1]], quick=True, markdown=str(md), json=str(js), update=True
        )
        assert report.main(update) == 0
        merged = json.loads(js.read_text())
        # The benchmark not re-run keeps its figures and run; the re-run one has its own.
        assert merged["benchmarks"][names[0]]["rows"] == [[1.5]]
        assert merged["benchmarks"][names[1]]["rows"] == [[9.0]]
        assert merged["date"] == first["date"] and merged["command"] == first["command"]
        assert "--update" in merged["benchmarks"][names[1]]["command"]
        text = md.read_text()
        assert "| 1.5 |" in text and "| 9 |" in text and "| 2.5 |" not in text
        assert text.index("## A") < text.index("## B")  # registry order kept
        assert text.count("; measured ") == 1 and "`megatron-ext bench --only" in text
        # --update needs the report it merges into, and names what is missing.
        with pytest.raises(ValueError, match="does not exist"):
            report.main(argparse.Namespace(**{**vars(update), "json": str(tmp_path / "no")}))
        with pytest.raises(ValueError, match="give all three"):
            report.main(argparse.Namespace(**{**vars(update), "only": None}))
    finally:
        for name in names:
            BENCHMARKS.pop(name)
