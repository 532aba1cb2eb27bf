"""Tier: Megatron on one rank. megatron_ext.cpu.model_stack patches are each still needed, idempotent, and loud.

Every group of ``cpu.*`` rows of the compatibility table is removed in turn on two gloo ranks of their own (tests/cpu_patch_probe.py: a real EP=2 training step
of the tiny MoE GPTModel) and the step must then fail on CPU, while it passes with all patches: when a megatron-core release
fixes one of these CUDA assumptions this test fails and names the patch that can go.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe() -> dict[str, str]:
    """Rank 0's outcomes, on 2 gloo ranks forked for the probe and stopped after it (it leaves
    their patches changed): no rank of another test's pool, no interpreter's imports."""
    from tests.cpu_patch_probe import probe

    return run_distributed(probe, 2, ep=2, fresh=True)[0]


def test_all_patches_make_a_moe_training_step_run(probe: dict[str, str]) -> None:
    # Positive control: without it, the "still needed" checks below could pass for unrelated reasons.
    assert probe["all_patches"] == "ok"
    assert probe["all_patches_sequence_parallel"] == "ok"
    assert probe["all_patches_ddp"] == "ok"
    assert probe["all_patches_recompute"] == "ok"
    assert probe["all_patches_shared_overlap"] == "ok"


CUDA_ERROR = ("NVIDIA driver", "CUDA", "cuda", "Torch not compiled")


@pytest.mark.parametrize("name", ["rng_tracker", "default_causal_mask", "schedule_buffers"])
def test_patch_still_needed(probe: dict[str, str], name: str) -> None:
    assert probe[name] != "ok", f"{name}: Megatron now runs this on CPU unpatched; drop the patch"
    assert any(word in probe[name] for word in CUDA_ERROR), probe[name]


def test_checkpoint_without_output_patch_still_needed(probe: dict[str, str]) -> None:
    # Selective recompute (layernorm, moe_act) asks TE's fp8 state, which is not there on CPU.
    assert probe["checkpoint_without_output"].startswith("NameError"), probe
    assert "FP8GlobalStateManager" in probe["checkpoint_without_output"]


def test_split_sizes_patch_still_needed(probe: dict[str, str]) -> None:
    # gloo's all_to_all_single rejects tensor split sizes, which is what Megatron hands it on CPU at EP=2.
    assert probe["split_sizes"].startswith("TypeError"), probe["split_sizes"]
    assert "all_to_all_single" in probe["split_sizes"]


def test_every_null_stream_patch_still_needed(probe: dict[str, str]) -> None:
    from megatron_ext.cpu.model_stack import _STREAM_USERS

    for module_name in _STREAM_USERS:
        outcome = probe[f"null_streams:{module_name}"]
        assert outcome != "ok", f"{module_name} no longer needs the null-stream patch"
        assert any(word in outcome for word in CUDA_ERROR), outcome


def test_every_current_device_patch_still_needed(probe: dict[str, str]) -> None:
    from megatron_ext.cpu.model_stack import _CURRENT_DEVICE_USERS

    for module_name in _CURRENT_DEVICE_USERS:
        outcome = probe[f"current_device:{module_name}"]
        assert outcome != "ok", f"{module_name} no longer needs the current_device patch"
        assert any(word in outcome for word in CUDA_ERROR), outcome


def test_missing_symbol_fails_loudly() -> None:
    from megatron_ext.compat import Patch, apply_rows
    from megatron_ext.compat.host_torch import HostTorch

    moved = Patch(group="cpu.current_device", module="megatron.core.transformer.moe.router",
                  attribute="TopKRouter.no_such_method", replacement=HostTorch(cuda=("current_device",)),
                  reason="", fingerprint="")  # fmt: skip
    with pytest.raises(RuntimeError, match="TopKRouter.no_such_method is gone"):
        apply_rows([moved])


def _enable_twice() -> tuple[bool, bool, bool]:
    from megatron.core.transformer.moe import router

    import megatron_ext.cpu.model_stack as cpu

    before = router.Router.gating.__code__
    again = cpu.enable_cpu_mode()
    return again, cpu.cpu_mode_enabled(), router.Router.gating.__code__ is before


def test_enable_cpu_mode_is_idempotent() -> None:
    # Workers enabled CPU mode at start; a second call must not rebind a function again.
    assert run_distributed(_enable_twice, 1) == [(True, True, True)]


def test_importing_the_package_patches_nothing() -> None:
    code = (
        "import megatron_ext, megatron_ext.training.arguments, megatron_ext.training.feature_configs;"
        "import megatron.core.transformer.moe.router as r, torch;"
        "assert r.torch is torch; import megatron_ext.cpu.model_stack as c; assert not c.cpu_mode_enabled();"
        "assert not any(n.startswith('_megatron_ext') for n in vars(r))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
