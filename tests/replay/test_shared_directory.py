"""Tier: gloo ranks (world 2). The record-mode startup check that the recording ranks share
``--route-record-path``'s filesystem: a shared directory passes and leaves nothing behind; a directory
per rank (what two nodes with local disks see) raises on every rank, without a hang; the run-state
entry the datasets provider calls runs the same check over Megatron's data-parallel group."""

import argparse
import os

import torch

from megatron_ext.testing import run_distributed


def _check(dirs: list[str]) -> str | None:
    from megatron_ext.replay.shared_directory import check_shared_directory

    rank = torch.distributed.get_rank()
    try:
        check_shared_directory(
            dirs[rank], rank, 2, prefix="rec", path=dirs[rank] + "/rec", timeout_s=0.5
        )
    except ValueError as exc:
        return str(exc)
    return None


def _check_through_run_state(root: str) -> str | None:
    from megatron_ext.replay import shared_directory
    from megatron_ext.training import run_state
    from megatron_ext.training.feature_configs import ReplayConfig

    rank = torch.distributed.get_rank()
    directory = os.path.join(root, f"rank{rank}") if root.endswith("split") else root
    args = argparse.Namespace()
    run_state.reset()
    config = ReplayConfig(route_replay_mode="record", route_record_path=f"{directory}/rec")
    run_state._STATE = run_state.RunState(args_id=id(args), configs={ReplayConfig: config})
    # The split directories' markers never appear: wait 0.5 s for them, not the default 10 s.
    default, shared_directory.MARKER_TIMEOUT_S = shared_directory.MARKER_TIMEOUT_S, 0.5
    try:
        run_state.check_record_directory(args)
    except ValueError as exc:
        return str(exc)
    finally:
        run_state.reset()
        shared_directory.MARKER_TIMEOUT_S = default
    return None


def test_a_shared_directory_passes_and_keeps_no_markers(tmp_path) -> None:
    assert run_distributed(_check, 2, [str(tmp_path)] * 2, timeout=60) == [None, None]
    assert os.listdir(tmp_path) == []  # markers removed (and no temporary files left)


def test_a_directory_per_rank_raises_on_every_rank(tmp_path) -> None:
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for d in dirs:
        os.mkdir(d)
    errors = run_distributed(_check, 2, dirs, timeout=60)  # returns: no rank hangs
    assert errors[0] is not None and errors[1] is not None  # the check really failed on both
    for rank, err in enumerate(errors):
        assert f"--route-record-path {dirs[rank]}/rec" in err
        assert "do not share the filesystem" in err
        assert "rank 0 does not see the files of ranks [1]" in err
        assert "rank 1 does not see the files of ranks [0]" in err
    assert os.listdir(dirs[0]) == [] and os.listdir(dirs[1]) == []


def test_run_state_checks_the_data_parallel_group(tmp_path) -> None:
    shared = tmp_path / "shared"
    split = tmp_path / "split"
    for d in (shared, split / "rank0", split / "rank1"):
        d.mkdir(parents=True)
    assert run_distributed(_check_through_run_state, 2, str(shared), timeout=60) == [None, None]
    errors = run_distributed(_check_through_run_state, 2, str(split), timeout=60)
    assert all(e is not None and "--route-record-path" in e for e in errors), errors
    assert os.listdir(shared) == []
