"""Tests for the loss guards of megatron_ext.training.forward_step. Tier: Megatron on one rank (its
rerun state machine) and Megatron's real training loop (2 gloo ranks, CPU).

The loss function validates the local loss with Megatron's rerun state machine as Megatron-LM's own
``pretrain_gpt.py`` does (NVIDIA/Megatron-LM d98e8a6, ``loss_func``): NaN and Inf fatal, a spiky loss
reported. Before, the guards were missing and a NaN was caught only later, in the gradient norm.
"""

import logging
import re

import pytest
import torch

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch
from megatron_ext.training.forward_step import SPIKY_LOSS_FACTOR, validate_loss

NAN = "found NaN in local forward loss calculation"


@pytest.fixture
def disabled_machine():
    """Megatron's rerun state machine with reruns off (``--rerun-mode disabled``): a rejected
    result raises (fatal) or warns at once. Its CPU rows are applied, as under ``--cpu`` (it names
    the CUDA device in its message)."""
    from megatron.core import rerun_state_machine as rsm

    from megatron_ext import compat

    with compat.patched("cpu_loop.rng_checkpoint"):
        rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
        yield rsm.get_rerun_state_machine()
        rsm.destroy_rerun_state_machine()


@pytest.mark.parametrize(("value", "what"), [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_a_nan_or_inf_local_loss_is_fatal(value, what, disabled_machine) -> None:
    view = MegatronView()
    assert view.check_for_nan_in_loss_and_grad  # Megatron's default
    with pytest.raises(RuntimeError, match=f"found {what} in local forward loss calculation"):
        validate_loss(torch.tensor(value), view)
    validate_loss(torch.tensor(2.5), view)  # a finite loss passes
    # --no-check-for-nan-in-loss-and-grad: not checked.
    validate_loss(torch.tensor(value), MegatronView(check_for_nan_in_loss_and_grad=False))


def test_a_spiky_loss_is_reported_only_when_asked(disabled_machine, caplog) -> None:
    spiky = MegatronView(check_for_spiky_loss=True)
    for _ in range(100):  # the machine learns the largest of its first 100 losses
        validate_loss(torch.tensor(1.0), spiky)
    with caplog.at_level(logging.WARNING):
        validate_loss(torch.tensor(SPIKY_LOSS_FACTOR * 0.9), spiky)
        assert "Spiky loss" not in caplog.text
        validate_loss(torch.tensor(1.0 * SPIKY_LOSS_FACTOR), MegatronView())  # not asked
        assert "Spiky loss" not in caplog.text
        validate_loss(torch.tensor(1.0 * SPIKY_LOSS_FACTOR), spiky)
    assert "Spiky loss" in caplog.text  # reported, not fatal


def test_one_ranks_nan_loss_stops_the_real_loop_before_the_step(corpus_prefix, tmp_path) -> None:
    """Rank 1's losses are NaN in iteration 2 (Megatron's default ``--rerun-mode
    validate_results`` checks from the second iteration on): Megatron's state machine names the
    loss check on rank 1, reruns the iteration in place, finds it reproducible, saves the last
    good checkpoint (iteration 1) and exits with its resume-to-disambiguate status; iteration 2
    never steps. (Without the guard the run went on: the gradient norm's own check fired
    first, on rank 0, naming no loss.)"""
    from megatron.core.rerun_state_machine import EXIT_CODE_RESUME_TO_DISAMBIGUATE

    run = launch(
        ["1", "2", *TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "3",
         "--save", str(tmp_path), "--save-interval", "100", "--ckpt-format", "torch"],
        module="tests.training.nan_loss_probe",
    )  # fmt: skip
    assert run.returncode == EXIT_CODE_RESUME_TO_DISAMBIGUATE, run.output[-3000:]
    found = re.findall(r"Unexpected result nan on rank (\d) at iteration #\d+ invocation #\d+ "
                       r"\(message='([^']+)'\)", run.output)  # fmt: skip
    assert found and found[0] == ("1", NAN), run.output[-3000:]
    assert "unexpected result is reproducible" in run.output, run.output[-3000:]
    assert set(run.losses) == {1}, run.losses  # iteration 1 stepped; iteration 2 never did
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
