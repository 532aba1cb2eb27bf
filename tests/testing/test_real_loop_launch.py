"""Tier: subprocesses (gloo ranks, no Megatron). ``megatron_ext.testing.real_loop.launch`` without
torchrun's agent: each rank gets torchrun's environment, one output stream comes back, and the first
rank to fail stops the others as the agent would (a peer left waiting for it would hang)."""

import time

from megatron_ext.testing.real_loop import launch

PROBE = "tests.testing.launch_probe"


def test_ranks_get_torchruns_environment_and_one_output():
    run = launch(["pass"], nproc=2, module=PROBE, timeout=120)
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        assert f"rank {rank} of 2 local {rank}" in run.output
        assert f"rank {rank} passed the barrier" in run.output


def test_a_failing_rank_stops_the_one_waiting_for_it():
    start = time.monotonic()
    run = launch(["fail"], nproc=2, module=PROBE, timeout=120)
    assert run.returncode == 3, run.output  # the failing rank's code, not the stopped one's
    assert "rank 0 joining" in run.output and "rank 0 of 2" not in run.output
    assert time.monotonic() - start < 60  # stopped, not left to gloo's 30-minute timeout
