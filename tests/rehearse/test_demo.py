"""Tier: subprocesses (Megatron's real training loop, 2 gloo ranks, four launches of examples/cpu_demo.sh and an RL step).

The CPU main job, as ``megatron-ext demo`` runs it from the installed wheel (the session's one demo
run, shared with tests/test_wheel.py: tests/installed_wheel.py): its JSON summary carries the
promised fields, comes from the real loop, and its checks hold; the interesting cases occurred (rows
mostly padding, constant pads skew per-expert load, the replaying model would have routed
differently).
"""

import argparse
from pathlib import Path

import pytest

from megatron_ext.rehearse.demo import LOSS_TOLERANCE, TRAINING_LOOP, main
from tests.installed_wheel import DEMO_STEPS


def test_demo_runs_the_real_loop_and_its_checks_hold(wheel_demo) -> None:
    printed, summary, png = wheel_demo.stdout, wheel_demo.summary, wheel_demo.png
    assert wheel_demo.returncode == 0, printed[-3000:] + wheel_demo.stderr[-3000:]
    for key in (
        "loss_equal",
        "peak_over_mean_constant",
        "peak_over_mean_self",
        "peak_over_mean_nopad",
        "replay_match_rate",
    ):
        assert key in summary
    assert summary["training_loop"] == TRAINING_LOOP == "megatron.training.pretrain"
    assert summary["iterations"] == DEMO_STEPS == 3 and len(summary["losses_self"]) == 3
    assert summary["loss_equal"] and summary["loss_max_abs_diff"] <= LOSS_TOLERANCE
    assert summary["losses_self"][-1] < summary["losses_self"][0]
    # The interesting case occurred: rows are largely padding and constant pads pile onto experts.
    assert summary["pad_fraction"] >= 0.4
    assert summary["expert_peak_over_mean_constant"] > summary["expert_peak_over_mean_self"] + 0.3
    assert summary["replay_rows"] > 0 and summary["replay_match_rate"] == 1.0
    # The pad runs trained at context parallelism 2 and the replay at 1 (as Megatron initialised
    # each): the hot spot and its removal above are under CP, and CP 2's routes replay at CP 1.
    assert summary["context_parallel"] == 2 and summary["replay_context_parallel"] == 1
    assert "[ok] replay at context parallelism 1 reproduces every route recorded at 2" in printed
    assert summary["natural_routing_changed"] > 0.2
    assert summary["alignment_ok"] and summary["alignment_multiple"] == [16]
    # Real-token throughput as the loop logged it: its pad fraction (host counts of the rows) is the
    # one the routers' real/all token counts give, and pads count as tokens but not as real ones.
    assert sorted(summary["throughput"]) == ["constant", "self", "skip"]
    for logged in summary["throughput"].values():
        assert abs(logged["pad_fraction"] - summary["pad_fraction"]) < 1e-9
        assert 0 < logged["real_tokens_per_s"] < logged["tokens_per_s"]
    assert "tokens/s as logged" in printed
    assert all(g % 16 == 0 for rank in summary["alignment_groups"] for g in rank)
    assert all(summary["checks"].values())
    assert png.stat().st_size > 10_000  # a real plot, not an empty file
    assert "[ok] loss equal under both pad policies" in printed
    # The three launches' logs were kept in --workdir, with the recorded route sidecar.
    work = wheel_demo.workdir
    assert {"constant.log", "self.log", "skip.log", "replay.log"} <= {
        p.name for p in work.iterdir()
    }
    # Skip mode: the experts got exactly the real rows, fewer than with self pads routed.
    assert 0 < summary["skip_expert_rows"] < 0.7 * summary["self_expert_rows"]
    assert "skip pads (--moe-pad-routing skip): expert rows" in printed
    assert (work / "corpus_text_document_routes.bin").stat().st_size > 0
    # The RL step: behaviour log-probs recorded under router jitter; the trainer's agree with them
    # far better with the recorded routes replayed than with its own routing (the jitter did act:
    # not 0 even with replay). Both sides' metrics are the loop's own rl/* log lines.
    rl = summary["rl_step"]
    assert {"rl_record.log", "rl_replay.log", "rl_native.log"} <= {p.name for p in work.iterdir()}
    assert 0 < 5 * rl["rl_replay_logprob_mismatch"] <= rl["rl_native_logprob_mismatch"], rl
    assert "rl_replay_clip_fraction" in rl and "rl_native_clip_fraction" in rl
    assert "[ok] RL step: replay cuts the trainer/behaviour log-prob mismatch" in printed
    assert (work / "corpus_text_document_logprobs.bin").stat().st_size > 0


def test_bad_demo_flags_are_refused_before_any_launch(tmp_path, capsys) -> None:
    """--steps below 2 (nothing to compare with iteration 1), a --workdir that is a file and a
    --png under a file each give one line naming the flag, exit 2, before training starts."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = dict(steps=3, json=None, png=str(tmp_path / "p.png"), workdir=str(tmp_path / "w"))
    for change, message in (
        ({"steps": 1}, "--steps must be at least 2, got 1"),
        ({"workdir": str(afile)}, "--workdir " + str(afile) + " is a file, not a directory"),
    ):
        assert main(argparse.Namespace(**{**base, **change})) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--png .*afile is a file, not a directory"):
        main(argparse.Namespace(**{**base, "png": str(afile / "x.png")}))
    assert not (tmp_path / "w").exists()  # nothing was started


def test_the_demo_without_matplotlib_names_the_extra_before_training(
    tmp_path, capsys, monkeypatch
) -> None:
    """After a plain ``pip install .`` (no ``[tools]``: matplotlib is not installed; tqdm, which
    the demo's preprocessing needs, is a base dependency), the demo says which extra to install,
    in one line, exit 2, before it starts anything."""
    import importlib.util
    import tomllib

    from megatron_ext.rehearse import demo

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "tqdm" in pyproject["project"]["dependencies"]
    assert "matplotlib" in pyproject["project"]["optional-dependencies"]["tools"]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        demo.importlib.util, "find_spec",
        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a),
    )  # fmt: skip
    args = dict(steps=3, json=None, png=str(tmp_path / "p.png"), workdir=str(tmp_path / "w"))
    assert main(argparse.Namespace(**args)) == 2
    err = capsys.readouterr().err
    assert err == (
        "megatron-ext demo: the per-expert load plot (--png) needs matplotlib, which is not "
        "installed: pip install 'megatron_ext[tools]'\n"
    )
    assert not (tmp_path / "w").exists() and not (tmp_path / "p.png").exists()
