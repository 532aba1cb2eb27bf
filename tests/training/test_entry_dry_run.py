"""Tier: Megatron on one process (``megatron_ext.pretrain_gpt.main --dry-run`` in this process, a
world of 2 ranks) and one subprocess of the entry.

What Megatron's ``validate_args`` passes but its ``pretrain`` fails on after startup is refused in
the dry run in one line (``training/launch_args.py``); the dry run reports the expert-group
alignment the dispatcher uses; Megatron's own argument errors are one line and exit 2. The
evaluation-data refusals of the same dry run: test_eval_args.py.
"""

import argparse
import os
import subprocess
import sys

import pytest

from tests.training.entry_args import BASE_ARGS, ROOT, dry_run_main


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--split", "99,1,0", "--eval-iters", "0"], "--eval-interval is required when training"),
        (
            ["--split", "99,1,0", "--eval-iters", "0", "--eval-interval", "9"]
            + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 2",
        ),
    ],
)
def test_what_megatron_validates_but_pretrain_fails_on_is_refused_in_the_dry_run(
    flags, named, data_prefix, monkeypatch, capsys
) -> None:
    """Megatron's validate_args passes both; its pretrain failed after startup with a traceback
    on every rank (a TypeError sizing validation samples; the expert grid at world size 2)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's own TP check, on a GPU
    assert dry_run_main(["--data-path", data_prefix, *flags], monkeypatch) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("flags", "align"),
    [
        ([], 0),  # bf16/fp32: no alignment
        (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], 16),
        (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], 32),
        (["--fp8-format", "e4m3", "--use-transformer-engine-op-fuser"], 256),  # CUTLASS's multiple
        (["--fp8-format", "e4m3", "--moe-dispatch-align-size", "64"], 64),
    ],
)
def test_the_dry_run_reports_the_alignment_the_dispatcher_uses(
    flags, align, data_prefix, monkeypatch, capsys
) -> None:
    from megatron_ext.moe.config import align_size_for_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    argv = ["--data-path", data_prefix, "--eval-iters", "0", "--eval-interval", "9"]
    argv += ["--moe-dispatch-align", "--bf16", *flags]
    assert dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f'"expert_group_alignment": {align},' in out, out[-2000:]
    config = argparse.Namespace(fp8=None, fp8_recipe=None, fp4=None, fp4_recipe=None)
    if "--use-transformer-engine-op-fuser" in flags:  # the dispatcher's rule agrees
        config.fp8, config.use_transformer_engine_op_fuser = "e4m3", True
        assert align_size_for_config(config, MoEAlignmentConfig(moe_dispatch_align=True)) == 256


def test_megatrons_own_argument_errors_are_one_line_and_exit_2() -> None:
    """Megatron's validate_args asserts (a global batch its micro-batches cannot divide): the
    entry prints one line naming the problem and exits 2, like its own refusals, not a
    traceback with status 1."""
    argv = [*BASE_ARGS, "--mock-data", "--global-batch-size", "7", "--dry-run"]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.pretrain_gpt", *argv],
        capture_output=True, text=True, env=env, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "megatron_ext: invalid arguments: " in proc.stderr and "(7)" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_routes_without_a_tokens_digest_are_refused_unless_the_flag_named_allows_them(
    data_prefix, tmp_path, monkeypatch, capsys
) -> None:
    """A route sidecar without a tokens digest cannot be told from routes left beside rewritten
    tokens of the same lengths: the launch (here its dry run) refuses it in one line naming the
    route file and the opt-out flag; doing exactly what the line says (adding that flag) passes.
    Writing the routes with the digest (what ``convert_routes.py --tokens-prefix`` does) passes
    without the flag. (A file without a header is refused alike: test_unsupported.py.)"""
    import re
    import shutil

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.replay.route_dataset import write_route_sidecar
    from tests.training.entry_args import EXPERTS, NUM_LAYERS, REPLAY_ARGS, TOPK

    prefix = str(tmp_path / "docs")
    for ext in (".bin", ".idx"):
        shutil.copy(data_prefix + ext, prefix + ext)
    tokens = IndexedDataset(prefix)  # held: its lengths are a view of its memory map
    lengths = tokens.sequence_lengths.tolist()

    def write_routes(tokens_prefix: str | None) -> None:
        routes = [np.tile(np.arange(TOPK, dtype=np.uint8), (n, NUM_LAYERS, 1)) for n in lengths]
        write_route_sidecar(
            prefix + "_routes", routes, num_layers=NUM_LAYERS, topk=TOPK, num_experts=EXPERTS,
            overwrite=True, tokens_prefix=tokens_prefix,
        )  # fmt: skip

    write_routes(None)
    argv = ["--data-path", prefix, *REPLAY_ARGS, "--eval-iters", "0", "--eval-interval", "9"]
    assert dry_run_main(argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"route file {prefix}_routes " in err, err
    flag = re.search(r"replay it anyway with (--[a-z-]+)$", err.strip())
    assert flag and flag.group(1) == "--route-replay-allow-undigested", err
    assert dry_run_main([*argv, flag.group(1)], monkeypatch) == 0, capsys.readouterr().err
    write_routes(prefix)  # with its tokens digest: no flag needed
    capsys.readouterr()
    assert dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err
