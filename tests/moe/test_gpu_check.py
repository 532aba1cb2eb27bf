"""Tier: pure subprocess (CPU) checks of the prepared GPU proof, tools/gpu_check.sh and
tools/gpu/gpu_check.py: the script's CPU smoke run (same code path, small sizes, torch._grouped_mm
in place of the fp8 kernel), the shell script's syntax and its dependency preflight."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_ext.rehearse.rank_env import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1"}


def _cpu_smoke(*flags: str) -> subprocess.CompletedProcess:
    """Runs ``gpu_check.py --cpu-smoke`` with ``flags`` (its one gloo rank on a free port: the
    script's default 29533 would be taken by the other run)."""
    return subprocess.run(
        [sys.executable, "tools/gpu/gpu_check.py", "--cpu-smoke", *flags],
        cwd=ROOT,
        env={**ENV, "MASTER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def smokes() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Both CPU smoke runs (with and without the alignment table), side by side: each is one
    single-threaded process, and the machine has 2 cores (their timings are not checked)."""
    variants = [(), ("--skip-alignment-table",)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(
            zip(variants, pool.map(lambda flags: _cpu_smoke(*flags), variants), strict=True)
        )


def test_launch_check_runs_the_startup_check_and_a_real_launch(corpus_prefix) -> None:
    """tools/gpu/launch_check.py's two steps with --cpu: the startup check a launch runs (the rows
    it applies) and its pretrain_gpt flags trained for 3 iterations on one gloo rank, read by its
    own result(). (Its torchrun call, for the GPU, is not run here: the rank is forked from the
    tests' preloaded server, the seconds of a fresh interpreter spared.)"""
    import importlib.util

    from megatron_ext.testing.real_loop import launch

    spec = importlib.util.spec_from_file_location(
        "launch_check", ROOT / "tools/gpu/launch_check.py"
    )
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.startup_check(cpu=True) == {
        "ok": True, "refused": None, "transformer_engine": False, "fused_rope": None,
    }  # fmt: skip
    flags = check.pretrain_flags(cpu=True, te=False, prefix=corpus_prefix)
    run = launch(flags, nproc=1)
    launched = check.result(flags, run.returncode, run.output)
    assert launched["transformer_impl"] == "local" and launched["ok"], launched
    assert len(launched["losses"]) == 3 and launched["losses"][-1] < launched["losses"][0]
    # On a GPU with Transformer Engine the same launch takes TE's modules, in bf16.
    gpu = check.pretrain_flags(cpu=False, te=True, prefix=corpus_prefix)
    assert "--bf16" in gpu and gpu[gpu.index("--transformer-impl") + 1] == "transformer_engine"


def _result(smokes, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The run with ``flags`` and its last JSON line (it must have exited 0)."""
    run = smokes[flags]
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(run.stdout.strip().splitlines()[-1])


def test_cpu_smoke_runs_the_guarded_layer_and_reports(smokes):
    run, result = _result(smokes)
    assert result["device"] == "cpu" and result["ok"] is True
    calls = result["aligned_guarded_calls"]
    # pad and strip ran once each inside the real layer forward, and the backward entered the
    # guarded span for x, probs (pad) and the expert output (strip).
    assert calls["pad"] == 1 and calls["strip"] == 1 and calls["backward"] >= 2, calls
    # The groups were checked where the expert GEMM receives them (fc1's forward input).
    assert calls["groups_checked"] == 1, calls
    # The all-gather layer (planned from host counts) ran the same guarded span, gave aligned
    # groups and the all-to-all layer's output (bitwise on CPU: same weights, same order).
    assert result["allgather_guarded_calls"] == calls, result
    assert result["allgather_groups_ok"] is True
    assert result["allgather_vs_alltoall_rel_err"] == 0.0
    assert result["aligned_groups_ok"] is True
    assert 0.1 < result["fp8_rel_err_bound"] < 0.25  # 2 * sqrt(2) * 2**-4
    # On CPU the "fp8" layer runs the same fp32 math as the bf16-configured one (Megatron's
    # unaligned path): the aligned path must equal it exactly, not merely within fp8's bound.
    assert result["fp8_vs_bf16_rel_err"] == 0.0 and result["fp8_vs_bf16_ok"] is True
    # The timing section ran, interleaved, and reported a paired ratio (its value is not checked:
    # numbers live in benchmarks).
    assert result["rounds"] == 2 and "router_padding_error" not in result, result
    lo, hi = result["ours_over_router_padding_min_max"]
    assert lo <= result["ours_over_router_padding"] <= hi, result
    # The alignment benchmark's EP=1 rows (the dispatcher's cost figures on a GPU) ran on this device: both
    # dispatchers, every precision, paired ratios inside their range, pads really added.
    assert "alignment_error" not in result, result.get("alignment_error")
    # The checks were printed on their own line first (a table outrunning the timeout keeps them).
    lines = run.stdout.strip().splitlines()
    later = ("replay", "replay_ok", "alignment")  # measured after the first line is printed
    assert len(lines) == 2 and json.loads(lines[0]) == {
        k: v for k, v in result.items() if k not in later
    }
    table = result["alignment"]
    assert sorted((r["dispatcher"], r["precision"]) for r in table) == sorted(
        (d, p) for d in ("alltoall", "allgather") for p in ("fp8", "mxfp8", "nvfp4")
    )
    for row in table:
        assert row["tokens/rank"] == 48 and row["rounds"] == 2, row
        assert row["ratio min"] <= row["ours/unaligned"] <= row["ratio max"], row
        assert row["pad rows ours"] > 0 and row["ops/trip ours"] > 0, row
    # Route replay on the device: install() made no host sync (CUDA's "error" mode on a GPU),
    # the forward replayed every recorded route, and the replay benchmark's ratios were measured.
    assert result["replay_ok"] is True and "replay_error" not in result, result
    replay = result["replay"]
    assert replay["install_host_syncs"] == [] and replay["replayed_exactly"] is True
    assert replay["native_routes_differ"] is True  # the replay really changed the routes
    assert replay["rounds"] == 2 and replay["ms_native"] > 0
    for name in ("ours_over_native", "ours_over_megatron", "native_again_over_native"):
        ratio = replay[name]
        assert ratio["min"] <= ratio["median"] <= ratio["max"], (name, ratio)


def test_cpu_smoke_can_skip_the_alignment_table(smokes):
    _, result = _result(smokes, "--skip-alignment-table")
    assert result["ok"] is True and "alignment" not in result and "alignment_error" not in result


def test_gpu_check_sh_syntax():
    subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=ROOT, check=True)


def test_gpu_check_sh_preflight_names_missing_packages(tmp_path):
    # A Python without site-packages (-S) has no torch/numpy/packaging, like a bare GPU box.
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    run = subprocess.run(
        ["bash", "tools/gpu_check.sh"],
        cwd=ROOT,
        env={**ENV, "PYTHON": str(bare)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "missing Python packages for megatron-core: torch numpy packaging" in run.stderr
