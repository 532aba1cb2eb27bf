"""Tier: subprocesses (Megatron's real ``pretrain`` on 1 gloo rank, CPU).

Every training-loop patch of :mod:`megatron_ext.cpu.training_loop` is still needed: with that one patch left out
(and every other in place), ``megatron_ext.pretrain_gpt --cpu`` fails, and the deepest Megatron frame of
the failure is in a module that patch covers. The positive control, the same launch with every patch,
trains (asserted here too), as do all the other real-loop tests.
"""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_ext.cpu import training_loop as cpu_loop
from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch

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
        *TINY_MOE_TEST_ARGS, "--data-path", prefix, "--train-iters", "1",
        "--expert-model-parallel-size", "1", "--global-batch-size", "2", "--log-params-norm",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--ckpt-format", ckpt_format,
    ]  # fmt: skip


def deepest_megatron_frame(output: str) -> str:
    """The last ``.../megatron/<path>.py`` frame of the traceback (one rank): the installed
    wheel's, or another megatron-core first on ``PYTHONPATH`` (make test-megatron-0.18.2)."""
    frames = re.findall(
        r'(?:\[rank0\]:)?\s+File ".*?/megatron/((?:core|training)/[^"]+)", line', output
    )
    assert frames, f"no Megatron frame in the failure:\n{output[-3000:]}"
    return frames[-1]


def test_every_patch_is_listed():
    assert set(PATCHED_FILES) == set(cpu_loop.PATCHES)


@pytest.fixture(scope="module")
def probes(corpus_prefix, tmp_path_factory) -> dict[str, tuple[LoopRun, Path]]:
    """The positive control and one launch per left-out patch, each a single process (forked from
    the preloaded server, see ``launch``), run two at a time on the machine's 2 cores."""
    jobs = {"all": ("megatron_ext.pretrain_gpt", None)}
    jobs.update({name: ("tests.cpu_loop_probe", name) for name in cpu_loop.PATCHES})

    def run(item: tuple[str, tuple[str, str | None]]) -> tuple[str, tuple[LoopRun, Path]]:
        name, (module, patch) = item
        fmt = "torch_dist" if patch == "checkpoint_dist" else "torch"
        workdir = tmp_path_factory.mktemp(name)
        args = _args(corpus_prefix, workdir, fmt)
        if patch == "checkpoint_dist":  # a failed save is one line unless --verbose (its frames)
            args.append("--verbose")
        return name, (launch([patch, *args] if patch else args, nproc=1, module=module), workdir)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, jobs.items()))


def test_positive_control_trains(probes):
    run, workdir = probes["all"]
    assert set(run.check().losses) == {1}
    assert (workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.slow
@pytest.mark.parametrize("patch", sorted(cpu_loop.PATCHES))
def test_loop_fails_without_patch(patch, probes):
    run, _ = probes[patch]
    assert run.returncode != 0, f"the loop trained without the {patch!r} patch: it is not needed"
    frame = deepest_megatron_frame(run.output)
    assert frame.startswith(PATCHED_FILES[patch]), (
        f"without {patch!r} the loop failed in {frame}, not in {PATCHED_FILES[patch]}"
    )
