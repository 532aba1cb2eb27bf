"""Tests for megatron_ext.training.loss_log. Tier: Megatron on one rank (the wrapper's checks) and
Megatron's real training loop (2 gloo ranks, CPU; the logged ``lm loss`` lines).

Every iteration's own loss is computed apart from Megatron's logging: ``tests/training/loss_probe.py``
prints each training micro-batch's masked loss sum and token count as ``loss_func`` returns them, and
the iteration's loss is the sum over ranks and micro-batches of the one over the other (what
Megatron 0.19.2's ``train_step`` reduces them to, ``megatron/training/training.py``). Each logged line
must be the mean of those losses over the iterations its interval holds.
"""

import re
from collections import defaultdict

import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch
from megatron_ext.training import loss_log

ITERATIONS = 4
_PROBE = re.compile(r"^loss probe: iteration (\d+) sum (\S+) tokens (\d+)$", re.M)
#: Megatron prints lm loss to 7 significant digits ({:.6E}: rounding <= 5e-7 relative); the sums
#: are reduced in another order than the probe's (float32 against float64), a few 1e-8 more.
REL = 1e-6


def _own_losses(run: LoopRun) -> dict[int, float]:
    """Each iteration's loss from the probe lines: sum of loss sums over sum of tokens."""
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    for iteration, total, tokens in _PROBE.findall(run.output):
        sums[int(iteration)][0] += float(total)
        sums[int(iteration)][1] += int(tokens)
    return {i: s / n for i, (s, n) in sorted(sums.items())}


def _probe(args: list[str]) -> tuple[LoopRun, dict[int, float]]:
    run = launch([*TINY_MOE_TEST_ARGS, *args], module="tests.training.loss_probe").check()
    return run, _own_losses(run)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def every_iteration(corpus_prefix, tmp_path_factory) -> tuple[LoopRun, dict[int, float], str]:
    """``--log-interval 1`` (TINY_MOE_TEST_ARGS'), saving at iteration 2 for the resume."""
    save = str(tmp_path_factory.mktemp("ckpt"))
    run, own = _probe([
        "--data-path", corpus_prefix, "--train-iters", str(ITERATIONS),
        "--save", save, "--save-interval", "2", "--ckpt-format", "torch",
    ])  # fmt: skip
    return run, own, save


@pytest.mark.slow
def test_every_logged_line_is_its_own_iteration(every_iteration) -> None:
    run, own, _save = every_iteration
    assert sorted(own) == sorted(run.losses) == list(range(1, ITERATIONS + 1))
    for i in own:
        assert run.losses[i] == pytest.approx(own[i], rel=REL, abs=0), (i, run.losses, own)
    # Not vacuous: Megatron 0.19.2's second line (the mean of iterations 1 and 2) is told apart.
    assert abs(_mean([own[1], own[2]]) - own[2]) > 20 * REL * own[2], own


@pytest.mark.slow
def test_a_resumed_run_logs_each_iteration_own_loss(every_iteration, corpus_prefix) -> None:
    """The first two lines after a resume (iterations 3 and 4 from the iteration-2 checkpoint)."""
    _run, uninterrupted, save = every_iteration
    resumed, own = _probe([
        "--data-path", corpus_prefix, "--train-iters", str(ITERATIONS),
        "--load", save, "--ckpt-step", "2", "--ckpt-format", "torch",
    ])  # fmt: skip
    assert sorted(own) == sorted(resumed.losses) == [3, 4], resumed.output[-3000:]
    for i in own:
        assert resumed.losses[i] == pytest.approx(own[i], rel=REL, abs=0), (i, resumed.losses)
    assert own == pytest.approx({i: uninterrupted[i] for i in own}, rel=REL)  # resumed in place
    assert abs(_mean([own[3], own[4]]) - own[4]) > 20 * REL * own[4], own


@pytest.mark.slow
def test_a_first_line_off_the_schedule_stays_in_its_interval(corpus_prefix) -> None:
    """``--log-interval 2``: iteration 1 is an extra line; the line at 2 averages the interval 1..2
    (Megatron's rule, kept), the line at 4 the interval 3..4."""
    run, own = _probe([
        "--data-path", corpus_prefix, "--train-iters", str(ITERATIONS), "--log-interval", "2",
    ])  # fmt: skip
    assert sorted(run.losses) == [1, 2, 4] and sorted(own) == list(range(1, ITERATIONS + 1))
    assert run.losses[1] == pytest.approx(own[1], rel=REL, abs=0)
    assert run.losses[2] == pytest.approx(_mean([own[1], own[2]]), rel=REL, abs=0)
    assert run.losses[4] == pytest.approx(_mean([own[3], own[4]]), rel=REL, abs=0)


@pytest.mark.parametrize(
    ("iteration", "interval", "regular"),
    [(1, 1, True), (1, 10, False), (10, 10, True), (51, 10, False), (60, 10, True), (7, 1, True)],
)
def test_first_line_is_regular_on_the_schedule_only(iteration, interval, regular) -> None:
    assert loss_log.first_line_is_regular(iteration, interval) is regular


def test_install_is_idempotent_and_keeps_megatron_signature(monkeypatch) -> None:
    from megatron.training import training

    monkeypatch.setattr(training, "training_log", training.training_log)
    original = training.training_log
    loss_log.install()
    wrapped = training.training_log
    assert wrapped is not original and wrapped.__wrapped__ is original
    loss_log.install()
    assert training.training_log is wrapped


def test_install_fails_loudly_when_megatron_moved_it(monkeypatch) -> None:
    from megatron.training import training

    monkeypatch.delattr(training, "training_log")
    with pytest.raises(RuntimeError, match="training_log is gone"):
        loss_log.install()

    def training_log(loss_dict, total_loss_dict, iteration):  # a reshaped future signature
        del loss_dict, total_loss_dict, iteration

    monkeypatch.setattr(training, "training_log", training_log, raising=False)
    with pytest.raises(RuntimeError, match=r"no longer takes \['is_first_iteration'\]"):
        loss_log.install()
