"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU): route replay, pad skipping
and the expert-load metrics under virtual pipeline stages.

A 4-layer MoE GPT records its routes (PP=1), then trains two iterations at PP=2 with those routes
replayed and saves a ``torch_dist`` checkpoint. From it, two runs train two more iterations with
full activation recompute, pads skipped, the routes replayed and checked: at PP=2, and at PP=2 x
VPP=2 (one layer per virtual stage: each rank runs two model chunks, micro-batches interleaved,
each chunk's recompute in backward after later micro-batches' forwards). The checkpoint makes the
weights the same (Megatron seeds each pipeline rank's initialisation apart, so two layouts built
from scratch start from different weights); the math is then the same, and so must be the losses,
every replayed row and each layer's expert load.
"""

import json
import os
import re
from pathlib import Path

import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch

LAYERS = 4
ARGS = [*TINY_MOE_TEST_ARGS, "--pack-documents", "--pad-to-seq-len", "--ckpt-format", "torch_dist"]
ARGS[ARGS.index("--num-layers") + 1] = str(LAYERS)
PP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "1"]
VPP2 = ["--num-layers-per-virtual-pipeline-stage", "1"]
REPLAY = ["--route-replay-mode", "replay", "--route-data-suffix", "_routes"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]  # fmt: skip
CHECKED = ["--route-replay-check", "--moe-expert-load-metrics", "--moe-pad-routing", "skip"]


@pytest.fixture(scope="module")
def resumed_runs(corpus_prefix, tmp_path_factory) -> dict[str, tuple[LoopRun, Path]]:
    root = tmp_path_factory.mktemp("vpp")
    prefix = str(root / "docs")
    for ext in (".bin", ".idx"):
        os.symlink(corpus_prefix + ext, prefix + ext)
    data = ["--data-path", prefix]
    launch([
        *ARGS, *data, "--train-iters", "4", "--route-replay-mode", "record",
        "--route-record-path", prefix + "_routes",
    ]).check()  # fmt: skip
    ckpt = str(root / "ckpt")
    launch([
        *ARGS, *data, *PP2, *REPLAY, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
        "--exit-interval", "2",
    ]).check()  # fmt: skip
    runs = {}
    for name, layout in (("pp2", PP2), ("pp2_vpp2", [*PP2, *VPP2])):
        log = root / f"{name}.jsonl"
        runs[name] = launch([
            *ARGS, *data, *layout, *REPLAY, *RECOMPUTE, *CHECKED, "--train-iters", "4",
            "--load", ckpt, "--moe-expert-load-log", str(log),
        ]), log  # fmt: skip
    return runs


def _layer_loads(log: Path) -> dict[tuple[int, str], list[int]]:
    """Per (iteration, layer): the tokens each expert got, from every pipeline stage's lines."""
    loads = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.endswith("/tokens"):
                loads[record["iteration"], key] = value
    return loads


def _replay_checks(log: Path) -> list[dict]:
    return [json.loads(line)["replay_check"] for line in log.read_text().splitlines()
            if "replay_check" in line]  # fmt: skip


def test_virtual_pipeline_stages_train_as_the_plain_pipeline(resumed_runs) -> None:
    (pp2, pp2_log), (vpp, vpp_log) = resumed_runs["pp2"], resumed_runs["pp2_vpp2"]
    pp2.check()
    vpp.check()
    assert "Memory penalty from interleaved schedule" in vpp.output  # really interleaved
    assert "Memory penalty from interleaved schedule" not in pp2.output
    assert sorted(pp2.losses) == [3, 4], pp2.output[-3000:]
    assert vpp.losses == pp2.losses
    # Each layer's expert load (pads skipped: real tokens only) equals the plain pipeline's:
    # counted once per micro-batch under recompute, on every virtual stage.
    loads = _layer_loads(vpp_log)
    assert sorted({layer for _, layer in loads}) == [f"layer{n}/tokens" for n in (1, 2, 3, 4)]
    assert loads == _layer_loads(pp2_log)
    rows = 8 * 128 * 2  # TINY_MOE_TEST_ARGS: 8 packs of 128 tokens per iteration, top-2
    # Once per micro-batch under recompute: counted twice, a layer would exceed the batch's rows.
    assert all(0 < sum(counts) <= rows for counts in loads.values()), loads
    # Every recorded (token, layer) row was routed exactly as recorded, in both layouts.
    for log in (pp2_log, vpp_log):
        checks = _replay_checks(log)
        assert checks and all(c["recorded"] > 0 for c in checks), checks
        assert all(c["recorded_exact"] == c["recorded"] for c in checks), checks
        assert all(c["missing_as_decided"] == c["missing"] for c in checks), checks
    assert "replay check: ERROR" not in vpp.output + pp2.output
    # The training packs' route coverage, logged once per launch and its origin told truly: pp2
    # counted its samples (16 to 32, after the resume) first, pp2_vpp2 read that count back.
    # Megatron builds the datasets once per virtual stage; a second line said "counted at an
    # earlier launch" of what this launch had just counted.
    earlier = " [counted at an earlier launch of the same data]"
    for run, suffix in ((pp2, ""), (vpp, earlier)):
        lines = re.findall(r"^> megatron_ext: route replay: .*$", run.output, re.M)
        assert len(lines) == 1 and lines[0].endswith(
            f"(0.00%; --route-replay-max-missing 0.05){suffix}"
        ), lines
