"""Tier: Megatron's real training loop (2 gloo ranks, CPU) saving into a full filesystem.

A ``torch_dist`` save onto a full disk ended the run with about 160 lines of tracebacks on every
rank (``CheckpointException ... error: <class 'OSError'>``), never naming the file nor saying
"No space left on device": Megatron's writer keeps only the failed write's exception class. Now
each rank prints one line naming the file it was writing and the cause, and exits 1
(``megatron_ext/training/checkpoint_save.py``). The full disk is a real one, a tiny tmpfs
(tests/filesystems.py: skipped where it cannot be mounted).
"""

import re

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch
from tests.filesystems import tiny_tmpfs


def test_a_save_onto_a_full_disk_is_one_line_per_rank_naming_the_file(
    corpus_prefix, tmp_path
) -> None:
    with tiny_tmpfs(tmp_path / "full", size="64k") as full:
        save = full / "ckpt"
        run = launch([*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, "--train-iters", "1",
                      "--save-interval", "1", "--save", str(save)])  # fmt: skip
        assert not (save / "latest_checkpointed_iteration.txt").exists()
    assert run.returncode == 1, run.output[-3000:]
    assert sorted(run.iterations) == [1]  # it trained, then the save failed
    assert "Traceback" not in run.output, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if line.startswith("megatron_ext: saving")]
    # The rank whose peer failed first may be stopped before it prints (as torchrun's agent does).
    assert 1 <= len(lines) <= 2, run.output[-3000:]
    for line in lines:
        assert re.fullmatch(
            rf"megatron_ext: saving the checkpoint of iteration 1 to {save} failed: writing "
            rf"{save}/iter_0000001/__(\d)_0\.distcp: .*No space left on device.*; {save} holds no "
            r"whole checkpoint \(rank (\d)\)",
            line,
        ), line
