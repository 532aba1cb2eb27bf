"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU, EP=2).

Self-token padding inside the training loop users run. Packs padded to ``--seq-length`` with the
pack's own tokens (``--pad-policy self``) or one constant id, pads dispatched to the experts
(``--moe-pad-routing dispatch``, so the two policies really route differently): the pads reach
other experts (the load log's all-token counts differ, its real-token counts do not), yet the
real-token loss, the load-balancing loss and the grad norm are the same every iteration, under
Megatron's default loss and under ``--calculate-per-token-loss``. And ``--step-batch-size-schedule``
(what Megatron 0.19.2 uses instead of the ``--rampup-batch-size`` it ignores, refused here at
argument time) ramps the batch of packed data.
"""

import json

import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch
from tests.training.loop_checks import without

PACKS = ("--pack-documents", "--pad-to-seq-len", "--moe-pad-routing", "dispatch")


def _train(corpus_prefix: str, log, policy: str, extra: list[str]):
    run = launch(
        [*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "4", *PACKS,
         "--pad-policy", policy, "--moe-expert-load-metrics", "--moe-expert-load-log", str(log),
         *extra]
    )  # fmt: skip
    run.check()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    fields = ("lm loss", "load_balancing_loss", "grad norm")
    logged = {i: tuple(f[k] for k in fields) for i, f in run.iterations.items()}
    return logged, records


def _counts(records: list[dict], prefix: str) -> list:
    return [[r[k] for k in sorted(r) if k.endswith(f"/{prefix}tokens")] for r in records]


@pytest.mark.parametrize("per_token_loss", [False, True])
def test_self_padding_routes_pads_elsewhere_and_trains_as_constant_padding(
    corpus_prefix, tmp_path, per_token_loss
) -> None:
    extra = ["--calculate-per-token-loss"] if per_token_loss else []
    runs = {
        p: _train(corpus_prefix, tmp_path / f"{p}.jsonl", p, extra) for p in ("self", "constant")
    }
    (self_logged, self_load), (const_logged, const_load) = runs["self"], runs["constant"]
    assert sorted(self_logged) == [1, 2, 3, 4]
    assert self_logged == const_logged  # exactly: pads are loss-masked and after every real token
    assert _counts(self_load, "real_") == _counts(const_load, "real_")
    # The interesting case occurred: packs held pads, and the two policies sent them elsewhere.
    every, real = _counts(self_load, ""), _counts(self_load, "real_")
    assert every and sum(map(sum, sum(every, []))) > sum(map(sum, sum(real, [])))
    assert every != _counts(const_load, "")


def test_step_batch_size_schedule_ramps_packed_batches(corpus_prefix) -> None:
    args = without(list(TINY_MOE_TEST_ARGS), "--global-batch-size")
    # Thresholds count tokens (Megatron reads them so when --seq-length is set): 2K = 16 packs.
    run = launch(
        [*args, "--data-path", corpus_prefix, "--train-iters", "6", *PACKS,
         "--step-batch-size-schedule", "0:4 2K:8"]
    )  # fmt: skip
    run.check()
    batches = [run.iterations[i]["global batch size"] for i in sorted(run.iterations)]
    consumed = [run.iterations[i]["consumed samples"] for i in sorted(run.iterations)]
    assert batches == [4, 4, 4, 4, 8, 8] and consumed == [4, 8, 12, 16, 24, 32]
    assert all(loss == loss and loss < 10 for loss in run.losses.values())  # finite
