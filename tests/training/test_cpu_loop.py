"""Tier: subprocesses (Megatron's real ``pretrain`` on 1 gloo rank, CPU).

Every training-loop patch of :mod:`megatron_ext.cpu_loop` is still needed: with that one patch left out
(and every other in place), ``megatron_ext.pretrain_gpt --cpu`` fails, and the deepest Megatron frame of
the failure is in a module that patch covers. The positive control, the same launch with every patch,
trains (asserted here too), as do all the other real-loop tests.
"""

import re

import pytest

from megatron_ext import cpu_loop
from megatron_ext.testing.real_loop import TINY_MOE_ARGS, launch

#: The Megatron files (under site-packages/megatron/) each patch covers.
PATCHED_FILES = {
    "initialize": ("training/initialize.py",),
    "training": ("training/training.py",),
    "timers": ("core/timers.py",),
    "optimizer": ("core/optimizer/optimizer.py",),
    "rng_checkpoint": ("training/checkpointing.py", "core/rerun_state_machine.py"),
    "checkpoint_dist": ("core/dist_checkpointing/strategies/",),
    "grad_norm": ("core/optimizer/clip_grads.py", "core/utils.py"),
    "common_utils": ("training/utils/common_utils.py",),
}


def _args(prefix: str, tmp_path, ckpt_format: str = "torch") -> list[str]:
    """One rank, one iteration, one save: the cheapest launch that reaches every patched call site."""
    return [
        *TINY_MOE_ARGS, "--data-path", prefix, "--train-iters", "1",
        "--expert-model-parallel-size", "1", "--global-batch-size", "2", "--log-params-norm",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--ckpt-format", ckpt_format,
    ]  # fmt: skip


def deepest_megatron_frame(output: str) -> str:
    """The last ``.../megatron/<path>.py`` frame of the traceback (one rank)."""
    frames = re.findall(
        r'(?:\[rank0\]:)?\s+File ".*?/site-packages/megatron/([^"]+)", line', output
    )
    assert frames, f"no Megatron frame in the failure:\n{output[-3000:]}"
    return frames[-1]


def test_every_patch_is_listed():
    assert set(PATCHED_FILES) == set(cpu_loop.PATCHES)


def test_positive_control_trains(corpus_prefix, tmp_path):
    run = launch(_args(corpus_prefix, tmp_path), nproc=1).check()
    assert set(run.losses) == {1}
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.slow
@pytest.mark.parametrize("patch", sorted(cpu_loop.PATCHES))
def test_loop_fails_without_patch(patch, corpus_prefix, tmp_path):
    ckpt_format = "torch_dist" if patch == "checkpoint_dist" else "torch"
    args = [patch, *_args(corpus_prefix, tmp_path, ckpt_format)]
    run = launch(args, nproc=1, module="tests.cpu_loop_probe")
    assert run.returncode != 0, f"the loop trained without the {patch!r} patch: it is not needed"
    frame = deepest_megatron_frame(run.output)
    assert frame.startswith(PATCHED_FILES[patch]), (
        f"without {patch!r} the loop failed in {frame}, not in {PATCHED_FILES[patch]}"
    )
