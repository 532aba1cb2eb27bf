"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU, EP=2 over the same ranks).

Context parallelism in the loop users run: each packed micro-batch is split per document by
Megatron's own ``get_batch_on_this_cp_rank`` (TE's partition index stood in under ``--cpu``), the
CPU context-parallel attention attends over the K/V of both ranks, self pads, grouped-GEMM experts
and pad skipping as usual. The documents are cut to multiples of 2 * CP = 4 tokens (the per-document
CP padding of the packs does that for any document; these need none), packs padded to
``--seq-length`` with their own tokens (the tail pad is its own segment). Four launches:

| launch                                   | proves                                                   |
|------------------------------------------|----------------------------------------------------------|
| CP=1 (DP=2), record routes R1            | the reference: losses, per-expert load                   |
| CP=2 (DP=1), record routes R2            | same losses and load every iteration; R2 == R1           |
| CP=2, replay R1, --route-replay-check,   | every recorded row replayed exactly at the token it was  |
|   --moe-pad-routing skip, fp8 rehearsal  | recorded for (the model's own router agrees), pads       |
|   + --moe-dispatch-align, load metrics   | skipped, groups aligned to 16, losses as the reference   |
| CP=1, replay R2, --route-replay-check    | a CP=2 record replays exactly at CP=1                    |

The global batch is the same (8 packs of 128): 4 micro-batches of 2 on one DP rank at CP=2, 2 on
each of two DP ranks at CP=1. ``--calculate-per-token-loss``: Megatron's default loss divides each
CP rank's loss by its own token count, so the two layouts would weight tokens differently (its
design, not a fault); per-token loss makes the gradient the same function of the same tokens.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch
from tests.training.loop_checks import EXPERTS, MOE_LAYERS, TOPK

ITERATIONS = 3
ROWS = 8 * 128 * MOE_LAYERS  # (token, layer) rows of one global batch
#: The loss line prints 6 decimals (Megatron's ``{:.6E}``). Both layouts sum the same fp32
#: products in another order (the attention's keys gathered over the CP group and reordered, the
#: gradients reduced over CP instead of DP): observed equal to the last printed digit at every
#: iteration; 5e-6 allows a rounding of the last digit either way plus the fp32 drift of 3 Adam
#: steps, and is 100 times smaller than the gap a wrong split left (a CP-dependent aux-loss
#: gradient, 6e-5 after one step; a router initialised from another RNG state, 8e-4 at step 1).
LOSS_TOL = 5e-6
GROUPED = ["--moe-grouped-gemm"]  # the fp8 rehearsal's experts, in every launch: the same weights
FP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--moe-dispatch-align"]


def _documents_of_multiples_of_four(prefix: str) -> None:
    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.training.corpus import corpus_documents

    docs = [d[: d.size // 4 * 4] for d in corpus_documents()]
    write_documents(prefix, [d for d in docs if d.size], np.int32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[LoopRun, Path]]:
    root = tmp_path_factory.mktemp("cp")
    prefix = str(root / "docs")
    _documents_of_multiples_of_four(prefix)
    common = [
        *TINY_MOE_TEST_ARGS, "--data-path", prefix, "--train-iters", str(ITERATIONS),
        "--pack-documents", "--pad-to-seq-len", "--calculate-per-token-loss",
        "--moe-expert-load-metrics", *GROUPED,
    ]  # fmt: skip
    cp2 = ["--context-parallel-size", "2"]
    record = ["--route-replay-mode", "record", "--route-record-path"]
    replay = ["--route-replay-mode", "replay", "--route-replay-check", "--route-data-suffix"]
    plan = {
        "cp1_record": [*record, prefix + "_r1"],
        "cp2_record": [*cp2, *record, prefix + "_r2"],
        "cp2_replay": [*cp2, *replay, "_r1", "--moe-pad-routing", "skip", *FP8, "--verbose"],
    }
    out = {}
    for name, extra in plan.items():
        log = root / f"{name}.jsonl"
        out[name] = launch([*common, "--moe-expert-load-log", str(log), *extra]).check(), log
    out["prefix"] = prefix  # type: ignore[assignment]
    return out


def _loads(log: Path) -> dict[tuple[int, str], list[int]]:
    """Per (iteration, layer): the real tokens each expert got (pads skipped)."""
    loads = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.endswith("/real_tokens"):
                loads[record["iteration"], key] = value
    return loads


def _checks(log: Path) -> list[dict]:
    lines = log.read_text().splitlines()
    return [json.loads(line)["replay_check"] for line in lines if "replay_check" in line]


def _assert_losses_close(run: LoopRun, reference: LoopRun, tol: float = LOSS_TOL) -> None:
    losses, want = run.losses, reference.losses
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), run.output[-3000:]
    assert all(abs(losses[i] - want[i]) <= tol for i in want), (losses, want)


def test_cp2_trains_as_cp1_and_records_the_same_routes(runs) -> None:
    (cp1, cp1_log), (cp2, cp2_log) = runs["cp1_record"], runs["cp2_record"]
    layout = "using world size: 2, data-parallel size: {}, context-parallel size: {}"
    assert layout.format(2, 1) in cp1.output and layout.format(1, 2) in cp2.output
    _assert_losses_close(cp2, cp1)
    assert cp1.losses[ITERATIONS] < cp1.losses[1]
    # Every expert's load, every layer and iteration: the same tokens reached the same experts.
    loads = _loads(cp2_log)
    assert len(loads) == ITERATIONS * MOE_LAYERS and loads == _loads(cp1_log)
    assert all(len(v) == EXPERTS and 0 < sum(v) <= 8 * 128 * TOPK for v in loads.values())
    # The CP=2 record put each CP rank's rows back by the per-document split: the same file.
    prefix = runs["prefix"]
    r1, r2 = (Path(prefix + s + ".bin").read_bytes() for s in ("_r1", "_r2"))
    assert len(r1) > 0 and r1 == r2


def test_cp1_routes_replay_exactly_at_cp2_with_pad_skip_alignment_and_load(runs) -> None:
    (replayed, log), (cp1, cp1_log) = runs["cp2_replay"], runs["cp1_record"]
    checks = _checks(log)
    assert len(checks) == ITERATIONS, replayed.output[-3000:]
    for check in checks:
        # Real tokens only (pads skipped reach no router row that counts): every recorded row
        # used exactly, none missing, and the model's own router agrees with every recorded row:
        # each route was replayed at the very token it was recorded for.
        assert 0 < check["recorded"] <= ROWS and check["recorded_exact"] == check["recorded"]
        assert check["missing"] == 0 and check["natural_differs"] == 0, check
    assert "replay check: ERROR" not in replayed.output
    assert "megatron_ext: --moe-pad-routing skip" in replayed.output
    # The fp8 rehearsal's aligned dispatch: every group that reached the grouped GEMM a multiple
    # of 16, and pads were added (more rows than routed pairs).
    groups = re.findall(r"rank \d rehearsal: (\d+) expert groups reached the grouped GEMM, (\d+) "
                        r"not a multiple of 16; last: \[([^\]]*)\]", replayed.output)  # fmt: skip
    assert len(groups) == 2 and all(int(n) > 0 and int(bad) == 0 for n, bad, _ in groups), groups
    # Load metrics under CP=2: the recorded routes, so the reference's per-expert load.
    assert _loads(log) == _loads(cp1_log)
    # Aligned groups change the GEMMs' row counts, not the math: the demo's tolerance.
    from megatron_ext.rehearse.demo import LOSS_TOLERANCE

    _assert_losses_close(replayed, cp1, max(LOSS_TOL, LOSS_TOLERANCE))


# Routes recorded at CP 2 replayed at CP 1, every recorded row exactly: the demo's replay run
# (tests/rehearse/test_demo.py: its pad runs record at CP 2, its replay runs at CP 1), one launch
# fewer here.
