"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU): ``--route-replay-check``
and ``--route-replay-max-missing`` in the real loop.

The sidecar is written so that what the data says is known without the pack plan: at MoE layer 0
a token's row is missing when its id is even, at layer 1 when it is odd, every other row holds a
random distinct top-2. Each real token has exactly one missing row, so per iteration its N real
tokens (of 8 packs x 128 positions, ``--pad-to-seq-len`` pads the rest) give N rows with a
recorded route and N without, whatever the packs hold, and the real tokens of the training packs
are exactly half missing. Pads are skipped (every launch here resolves ``--moe-pad-routing auto``
to ``skip``): they reach no expert and are not counted as replayed; N comes from the expert-load
records (pads count 0 there), N < 1024 where pads occurred (iteration 1: 992).

| launch                                  | proves                                                   |
|-----------------------------------------|----------------------------------------------------------|
| plain, full recompute, selective ``moe`` | the counts equal the data's, identical under recompute   |
| ``--replay-missing-route-policy balanced`` | the data's filled rows are counted apart from recorded   |
| PP=2                                    | each stage counts its layer's rows once per micro-batch   |
| ``--route-replay-max-missing 0.4``      | a run whose data is half missing is refused              |
| every row missing, limit 1              | reported as nothing replayed, never as replayed exactly  |
"""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch
from tests.training.loop_checks import EXPERTS, ITERATIONS, MOE_LAYERS, TOPK, assert_trains

#: TINY_MOE_TEST_ARGS: --global-batch-size 8, --seq-length 128.
ROWS_PER_LAYER = 8 * 128
REPLAY = ["--pack-documents", "--pad-to-seq-len", "--route-replay-mode", "replay",
          "--route-data-suffix", "_routes", "--route-replay-check",
          "--moe-expert-load-metrics"]  # fmt: skip


def _sidecar(corpus_prefix: str, root: Path, every_row_missing: bool = False) -> str:
    """The corpus's tokens (linked) with a route sidecar missing one layer's row per token by
    token parity (or every row)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.replay.route_dataset import write_route_sidecar

    prefix = str(root / "docs")
    for ext in (".bin", ".idx"):
        os.symlink(corpus_prefix + ext, prefix + ext)
    tokens = IndexedDataset(prefix)
    rng = np.random.default_rng(0)
    routes = []
    for d in range(len(tokens)):
        tokens_T = np.asarray(tokens[d])
        keys = rng.random((tokens_T.size, MOE_LAYERS, EXPERTS))
        routes_TLK = np.argsort(keys, axis=-1)[..., :TOPK].astype(np.uint8)
        routes_TLK[tokens_T % 2 == 0, 0] = 255
        routes_TLK[tokens_T % 2 == 1, 1] = 255
        if every_row_missing:
            routes_TLK[:] = 255
        routes.append(routes_TLK)
    write_route_sidecar(
        prefix + "_routes", routes, num_layers=MOE_LAYERS, topk=TOPK, num_experts=EXPERTS,
        flag="test", tokens_prefix=prefix,
    )  # fmt: skip
    return prefix


@pytest.fixture(scope="module")
def parity_prefix(corpus_prefix, tmp_path_factory) -> str:
    return _sidecar(corpus_prefix, tmp_path_factory.mktemp("parity"))


def _checked_run(prefix: str, log: Path, extra: list[str], nproc: int = 2) -> LoopRun:
    return launch([
        *TINY_MOE_TEST_ARGS, "--data-path", prefix, "--train-iters", str(ITERATIONS), *REPLAY,
        "--moe-expert-load-log", str(log), *extra,
    ], nproc=nproc)  # fmt: skip


def _check_records(log: Path) -> list[dict]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [line for line in lines if "replay_check" in line]


def _real_tokens(log: Path) -> dict[int, int]:
    """Per iteration: the real tokens the MoE layers routed (each layer's real expert load / top-k;
    the same at every layer), fewer than the 1024 positions where pads occurred."""
    per_layer: dict[int, set[int]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.endswith("/real_tokens"):
                per_layer.setdefault(record["iteration"], set()).add(sum(value) // TOPK)
    assert sorted(per_layer) == list(range(1, ITERATIONS + 1)), per_layer
    assert all(len(n) == 1 for n in per_layer.values()), per_layer
    real = {i: n.pop() for i, n in per_layer.items()}
    assert all(0 < n <= ROWS_PER_LAYER for n in real.values()), real
    assert min(real.values()) < ROWS_PER_LAYER, real  # pads occurred (iteration 1's packs)
    return real


def test_replay_check_counts_what_the_data_says_with_and_without_recompute(
    parity_prefix, tmp_path
) -> None:
    """Recompute ran the counted forwards without grad (the check printed 0/0 before)."""
    runs, records = {}, {}
    for name, extra in (
        ("plain", []),
        ("full", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]),
        ("selective", ["--recompute-granularity", "selective", "--recompute-modules", "moe",
                       "--log-arguments"]),
    ):  # fmt: skip
        log = tmp_path / f"{name}.jsonl"
        runs[name] = _checked_run(parity_prefix, log, ["--route-replay-max-missing", "0.5", *extra])
        assert_trains(runs[name])
        records[name] = _check_records(log)
    plain, real = records["plain"], _real_tokens(tmp_path / "plain.jsonl")
    assert [r["iteration"] for r in plain] == list(range(1, ITERATIONS + 1)), plain
    for r in plain:
        counts, n = r["replay_check"], real[r["iteration"]]
        assert counts["recorded"] == counts["missing"] == n, (counts, n)  # pads not counted
        assert counts["recorded_exact"] == counts["missing_as_decided"] == n, (counts, n)
        assert 0 < counts["natural_differs"] <= n, counts  # random routes
        assert counts["policy"] == "native"
    # Recompute changes neither a count nor a loss.
    assert records["full"] == plain and records["selective"] == plain
    assert runs["full"].losses == runs["plain"].losses == runs["selective"].losses
    assert re.search(r"recompute_modules \.+ \['moe'\]", runs["selective"].output)
    # Startup: the training packs' real tokens are half missing, under the limit 0.5.
    startup = re.findall(r"have no recorded route \(([0-9.]+)%; --route-replay-max-missing 0.5\)",
                         runs["plain"].output)  # fmt: skip
    assert startup == ["50.00"], runs["plain"].output[-3000:]
    lines = re.findall(r"megatron_ext replay check: (.*)", runs["plain"].output)
    assert len(lines) == ITERATIONS, lines
    assert all(line.startswith(f"{n} (token, layer) rows with a recorded route, {n} used exactly; "
                               f"{n} without one, {n} routed by the model's own router (native)")
               for line, n in zip(lines, real.values(), strict=True)), lines  # fmt: skip


def test_replay_check_tells_balanced_fills_from_recorded_rows(parity_prefix, tmp_path) -> None:
    """``balanced`` fills the missing rows in the data: its mask of the filled rows reaches the
    check through the batch (without it, every row would count as recorded)."""
    log = tmp_path / "balanced.jsonl"
    run = _checked_run(parity_prefix, log, [
        "--route-replay-max-missing", "0.5", "--replay-missing-route-policy", "balanced",
    ])  # fmt: skip
    assert_trains(run)
    records, real = _check_records(log), _real_tokens(log)
    assert len(records) == ITERATIONS, records
    for r in records:
        c, n = r["replay_check"], real[r["iteration"]]
        assert c["policy"] == "balanced" and c["missing"] == n, (c, n)
        assert (c["recorded"], c["recorded_exact"], c["missing_as_decided"]) == (n,) * 3, (c, n)
    assert f"{n} filled with a balanced top-k (balanced), routed as filled" in run.output


def test_replay_check_counts_each_pipeline_stage_once(parity_prefix, tmp_path) -> None:
    """PP=2: stage 0 holds MoE layer 0 (even tokens missing), stage 1 layer 1 (odd ones)."""
    log = tmp_path / "pp.jsonl"
    run = _checked_run(parity_prefix, log, [
        "--route-replay-max-missing", "0.5", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "1",
    ])  # fmt: skip
    assert_trains(run)
    by_iteration: dict[int, dict[int, dict]] = {}
    for r in _check_records(log):
        by_iteration.setdefault(r["iteration"], {})[r["pipeline_stage"]] = r["replay_check"]
    assert sorted(by_iteration) == list(range(1, ITERATIONS + 1)), by_iteration
    real = _real_tokens(log)
    for iteration, stages in by_iteration.items():
        first, second = stages[0], stages[1]
        for c in (first, second):  # each micro-batch's rows once: one row per real token
            assert c["recorded"] + c["missing"] == real[iteration], stages
            assert (c["recorded_exact"], c["missing_as_decided"]) == (c["recorded"], c["missing"])
        # A position is missing at exactly one of the two layers.
        assert first["recorded"] == second["missing"] and first["missing"] == second["recorded"]
        assert 0 < first["recorded"] < real[iteration], stages  # both parities occurred


def test_a_run_whose_data_has_too_many_missing_routes_is_refused(parity_prefix, tmp_path) -> None:
    run = _checked_run(
        parity_prefix, tmp_path / "refused.jsonl", ["--route-replay-max-missing", "0.4"]
    )
    assert run.returncode == 2, run.output[-3000:]
    assert re.search(
        r"^megatron_ext: invalid data: --route-replay-max-missing 0.4: \d+ of \d+ \(token, layer\) "
        r"rows \(50.00%\) of the training data have no recorded route", run.output, re.M
    ), run.output[-3000:]  # fmt: skip
    assert "Traceback" not in run.output  # one line, not a traceback
    assert not re.search(r"iteration\s+1/", run.output)  # refused before training


def test_a_sidecar_without_any_route_is_not_reported_as_replayed(corpus_prefix, tmp_path) -> None:
    """Every row missing (e.g. every row rejected by convert_routes.py): refused by the default
    limit; accepted with limit 1, the check says nothing was replayed, at every log."""
    prefix = _sidecar(corpus_prefix, tmp_path, every_row_missing=True)
    refused = _checked_run(prefix, tmp_path / "refused.jsonl", [])
    assert refused.returncode != 0
    assert "--route-replay-max-missing 0.05: " in refused.output, refused.output[-3000:]
    log = tmp_path / "missing.jsonl"
    run = _checked_run(prefix, log, ["--route-replay-max-missing", "1"])
    assert_trains(run)
    records, real = _check_records(log), _real_tokens(log)
    assert len(records) == ITERATIONS, records
    for r in records:
        c, n = r["replay_check"], real[r["iteration"]]
        assert (c["recorded"], c["recorded_exact"], c["natural_differs"]) == (0, 0, 0), c
        assert c["missing"] == c["missing_as_decided"] == MOE_LAYERS * n, (c, n)
    warnings = re.findall(r"megatron_ext replay check: WARNING: no row of this interval had a "
                          r"recorded route: nothing was replayed", run.output)  # fmt: skip
    assert len(warnings) == ITERATIONS, run.output[-3000:]
    assert "used exactly; 0 without" not in run.output
