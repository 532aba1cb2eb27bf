"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU): ``--rl-loss ppo`` on
behaviour log-probs and routes recorded by ``--route-replay-mode record --rl-record-logprobs``.

Two launches: ``record`` of the tiny model's first step, then one step of ``--rl-loss ppo`` with
replay on what it wrote. Same seed, so the weights and the packs of step 1 are the recording's:
the importance ratio is exactly 1, which checks the whole path (the recording forward's per-token
log-probs put back at their documents' tokens, packed again with the tokens, aligned with the
labels, and the loss reading them). That replay removes the mismatch the engine's routing leaves
is shown in the user's own loop, examples/replay_in_your_loop.py (its test: tests/test_examples.py).
"""

import pytest

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch
from tests.training.rl_data import write_rl_data

RECORD = ["--route-replay-mode", "record", "--route-record-path", "{P}_routes",
          "--rl-record-logprobs", "{P}_logprobs"]  # fmt: skip
REPLAY = ["--route-replay-mode", "replay", "--route-data-suffix", "_routes"]
RL = ["--rl-loss", "ppo", "--calculate-per-token-loss"]


def _launch(prefix: str, *extra: str) -> LoopRun:
    args = [
        *TINY_MOE_TEST_ARGS, "--data-path", prefix, "--pack-documents", "--pad-to-seq-len",
        "--pack-loss-mask-suffix", "_loss_mask", "--train-iters", "1",
        *(a.replace("{P}", prefix) for a in extra),
    ]  # fmt: skip
    run = launch(args)
    assert run.returncode == 0, run.output[-3000:]
    return run


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> str:
    """The RL data (tokens, loss mask, advantages) with the routes and log-probs one record
    launch wrote beside it."""
    prefix = str(tmp_path_factory.mktemp("rl") / "rl")
    write_rl_data(prefix)
    run = _launch(prefix, *RECORD)
    assert "megatron_ext: wrote recorded log-probs of 64 documents" in run.output
    return prefix


def test_behaviour_log_probs_of_the_same_weights_give_a_ratio_of_exactly_one(recorded) -> None:
    run = _launch(recorded, *REPLAY, *RL)
    step = run.iterations[1]
    # Same weights, same packs, the recorded routes: the same float32 forward, so the trainer's
    # log-probs equal the recorded ones bit for bit (tolerance: fp32 rounding, 1e-6; seen 0).
    assert step["rl/logprob_mismatch"] <= 1e-6, step
    assert abs(step["rl/ratio_mean"] - 1.0) <= 1e-6 and step["rl/kl_k3"] <= 1e-9, step
    assert step["rl/clip_fraction"] == 0.0, step
    assert step["policy loss"] != 0.0 and step["lm loss"] > 0, step  # advantages of both signs
    assert "0 of" in run.output and "have no recorded route (0.00%" in run.output
