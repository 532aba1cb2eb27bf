"""Tier: gloo ranks. The rank-pool harness: results, parallel sizes, failures, dead ranks and
hangs."""

import os
import time

import pytest
import torch

from megatron_ext.testing import run_distributed


def _sizes_and_sum(value: int) -> dict:
    from megatron.core import parallel_state as ps

    total = torch.tensor([value + torch.distributed.get_rank()])
    torch.distributed.all_reduce(total)
    return {
        "rank": torch.distributed.get_rank(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "sum": int(total),
    }


def test_results_come_back_in_rank_order_with_requested_sizes() -> None:
    out = run_distributed(_sizes_and_sum, 2, 10, ep=2)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["ep_rank"] for o in out] == [0, 1]
    assert all(o["ep"] == 2 and o["tp"] == 1 and o["sum"] == 21 for o in out)
    # Same pool, different sizes: parallel state is rebuilt per call.
    out = run_distributed(_sizes_and_sum, 2, 0, tp=2)
    assert all(o["tp"] == 2 and o["ep"] == 1 for o in out)


def test_four_ranks_tp2_ep2() -> None:
    out = run_distributed(_sizes_and_sum, 4, 1, tp=2, ep=2)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["tp"] == 2 and o["ep"] == 2 and o["sum"] == 10 for o in out)


def _fail_on_rank_one() -> int:
    if torch.distributed.get_rank() == 1:
        raise ValueError("planted failure on rank one")
    return 0


def test_a_failing_rank_fails_the_call_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed(.|\n)*planted failure on rank one"):
        run_distributed(_fail_on_rank_one, 2)
    # The pool is rebuilt and usable afterwards.
    assert [o["rank"] for o in run_distributed(_sizes_and_sum, 2, 0)] == [0, 1]


def _hang_on_rank_one() -> int:
    if torch.distributed.get_rank() == 1:
        time.sleep(600)
    return 0


def test_a_hung_rank_fails_by_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 did not finish"):
        run_distributed(_hang_on_rank_one, 2, timeout=3)
    assert time.monotonic() - start < 60
    assert [o["rank"] for o in run_distributed(_sizes_and_sum, 2, 0)] == [0, 1]


def _exit_on_rank_one() -> int:
    if torch.distributed.get_rank() == 1:
        os._exit(3)  # a crash: no exception, no answer
    return 0


def test_a_dead_rank_is_named_with_its_exit_code_not_as_hung() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_exit_on_rank_one, 2, timeout=600)
    message = str(info.value)
    assert "rank 1 of 2: its worker process exited with code 3" in message, message
    assert "if __name__ == '__main__':" in message
    assert "did not finish" not in message  # rank 0 answered; nothing hung
    assert time.monotonic() - start < 60  # not the 600 s timeout
    assert [o["rank"] for o in run_distributed(_sizes_and_sum, 2, 0)] == [0, 1]


def _mark_tracker(mark: str) -> str | None:
    from megatron.core.transformer.moe import moe_logging

    tracker = moe_logging.get_moe_metrics_tracker()
    previous = getattr(tracker, "_test_mark", None)
    tracker._test_mark = mark
    return previous


def test_megatron_global_moe_metrics_tracker_is_reset_between_calls() -> None:
    run_distributed(_mark_tracker, 1, "first call")
    # A fresh tracker per call, not the one the previous call's model sized.
    assert run_distributed(_mark_tracker, 1, "second call") == [None]


def _worker_origin(name: str) -> tuple[str | None, bool, int]:
    import sys

    return os.environ.get(name), "megatron.core.parallel_state" in sys.modules, os.getppid()


def test_forked_workers_run_under_the_builders_environment(monkeypatch) -> None:
    """The session forks its workers from a server that imported Megatron before the pool's
    builder set anything; each worker still sees the builder's environment, as a spawned one."""
    from megatron_ext.testing import distributed

    assert distributed._START_METHOD == "forkserver"  # tests/conftest.py
    distributed.shutdown_pools()
    monkeypatch.setenv("MEGATRON_EXT_POOL_PROBE", "built after the server")
    [(value, preloaded, parent)] = run_distributed(_worker_origin, 1, "MEGATRON_EXT_POOL_PROBE")
    assert value == "built after the server"
    assert preloaded and parent != os.getpid()  # forked by the server, not by this process


def test_spawned_workers_are_fresh_interpreters(monkeypatch) -> None:
    """The default outside the tests (the benchmarks): each worker a child of the builder."""
    from megatron_ext.testing import distributed

    distributed.shutdown_pools()
    monkeypatch.setattr(distributed, "_START_METHOD", "spawn")
    monkeypatch.setenv("MEGATRON_EXT_POOL_PROBE", "spawned")
    try:
        [(value, _, parent)] = run_distributed(_worker_origin, 1, "MEGATRON_EXT_POOL_PROBE")
    finally:
        distributed.shutdown_pools()
    assert value == "spawned" and parent == os.getpid()


def test_a_forked_pool_is_replaced_after_many_changes_of_parallel_sizes(monkeypatch) -> None:
    """Each change of sizes leaves the old gloo groups' threads polling; past the limit the
    session's forked pool gets fresh workers (same sizes again and again change nothing)."""
    from megatron_ext.testing import distributed

    monkeypatch.setattr(distributed, "MAX_GROUP_CHANGES", 2)
    distributed.shutdown_pools()
    first = run_distributed(os.getpid, 2)
    assert run_distributed(os.getpid, 2) == first
    assert [run_distributed(os.getpid, 2, tp=tp) for tp in (2, 1)] == [first, first]
    replaced = run_distributed(os.getpid, 2, tp=2)  # the third change
    assert set(replaced).isdisjoint(first)
    assert run_distributed(_sizes_and_sum, 2, 0, tp=2)[0]["tp"] == 2


def test_an_idle_forked_pool_closes_itself_and_the_next_call_forks_a_new_one(monkeypatch) -> None:
    """Idle workers' gloo threads keep spending CPU; a pool unused for IDLE_CLOSE_S closes (its
    workers exit) and the next call gets fresh workers. A call in time keeps the same ones."""
    import time

    from megatron_ext.testing import distributed

    monkeypatch.setattr(distributed, "IDLE_CLOSE_S", 0.5)
    distributed.shutdown_pools()
    first = run_distributed(os.getpid, 2)
    assert run_distributed(os.getpid, 2) == first  # the timer restarts with each call
    procs = distributed._POOLS[2].procs
    deadline = time.monotonic() + 30
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(proc.is_alive() for proc in procs) and 2 not in distributed._POOLS
    again = run_distributed(os.getpid, 2)
    assert set(again).isdisjoint(first)
