"""``megatron-ext rehearse``: a configurations file, one line of result per configuration.

Tier: pure (the file format, the classification of a finished launch) and one real sweep: Megatron's
real ``pretrain`` in ranks forked from the preloaded server, a configuration that trains beside one
Megatron's argument validation refuses.
"""

import re
import subprocess
import sys

import pytest

from megatron_ext.rehearse import matrix as rehearse
from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun
from tests.training.entry_args import ROOT


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "sweep.txt"
    path.write_text(text)
    return str(path)


def test_configurations_file_lines_comments_and_quoting(tmp_path):
    path = _write(
        tmp_path,
        "# a sweep\n\nalltoall: --moe-token-dispatcher-type alltoall  # the default\n"
        "  with spaces : --lr 1e-3 --tensorboard-dir 'a b'\n",
    )
    got = rehearse.read_configurations(path)
    assert got == [
        rehearse.Configuration("alltoall", ("--moe-token-dispatcher-type", "alltoall")),
        rehearse.Configuration("with spaces", ("--lr", "1e-3", "--tensorboard-dir", "a b")),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("--lr 1e-3\n", r"sweep.txt:1: expected 'NAME: FLAGS'"),
        ("a: --lr 1\n\na: --lr 2\n", r"sweep.txt:3: configuration name 'a' repeated"),
        ("a: --x 'open\n", r"sweep.txt:1: No closing quotation"),
        ("# only a comment\n", r"sweep.txt: no configurations"),
    ],
)
def test_bad_configurations_file_names_file_and_line(tmp_path, text, error):
    with pytest.raises(ValueError, match=error):
        rehearse.read_configurations(_write(tmp_path, text))


def test_a_crash_is_reported_by_its_first_error():
    output = (
        "megatron_ext: --moe-pad-routing dispatch\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "RuntimeError: Gloo connectFullMesh failed\n"
        "torch.distributed.DistBackendError: a later error\n"
    )
    outcome = rehearse.outcome_of("c", LoopRun(argv=[], returncode=1, output=output), 1.0)
    assert (outcome.status, outcome.message) == (
        "crashed",
        "exit 1: RuntimeError: Gloo connectFullMesh failed",
    )
    # Exit 2 without megatron_ext's refusal line is a crash too, reported by its last line.
    outcome = rehearse.outcome_of("c", LoopRun(argv=[], returncode=2, output="usage: x\n"), 1.0)
    assert (outcome.status, outcome.message) == ("crashed", "exit 2: usage: x")


def test_a_stopped_configuration_keeps_its_log(tmp_path, monkeypatch):
    """``--timeout``: the configuration is reported as crashed and, with ``--log-dir``, its log
    holds what the ranks printed until they were stopped, and says so."""
    from megatron_ext.rehearse import local_launch

    def launch(args, *, nproc, timeout):
        raise subprocess.TimeoutExpired(args, timeout, output="rank 0 joining\n")

    monkeypatch.setattr(local_launch, "launch", launch)
    configurations = [rehearse.Configuration("slow one", ("--train-iters", "2"))]
    (outcome,) = rehearse.rehearse(configurations, [], timeout=5, log_dir=tmp_path, echo=False)
    assert (outcome.status, outcome.message) == ("crashed", "timed out after 5 s")
    assert (tmp_path / "slow_one.log").read_text() == (
        "rank 0 joining\nmegatron-ext rehearse: stopped after 5 s (--timeout)\n"
    )


def test_a_sweep_reports_trained_and_refused_configurations(
    corpus_prefix, tmp_path, capsys, monkeypatch
):
    """``megatron-ext rehearse``'s ``main`` in this process (its ranks fork from the tests' server;
    the command's own interpreter runs in the test below). ``again`` loads the checkpoint ``tiny``
    saved at iteration 2 with ``--train-iters 2``: Megatron trains nothing and exits 0, which is
    said as such, not counted as trained."""
    from megatron_ext.cli.command import main

    ckpt = f"--ckpt-format torch --save-interval 2 --save {tmp_path / 'ckpt'}"
    path = _write(
        tmp_path,
        f"tiny: --train-iters 2 {ckpt}\n"
        "bad ep: --expert-model-parallel-size 3 --train-iters 2\n"
        f"again: --train-iters 2 --ckpt-format torch --load {tmp_path / 'ckpt'}\n",
    )
    common = [*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix]
    monkeypatch.chdir(ROOT)
    status = main(["rehearse", "--log-dir", str(tmp_path / "logs"), path, "--", *common])
    printed = capsys.readouterr()
    assert status == 1, printed.out + printed.err[-3000:]  # two did not train
    lines = printed.out.splitlines()
    trained = re.fullmatch(
        r"trained  tiny    losses (\S+) (\S+)  step \d+ ms  \(\d+\.\d s\)", lines[0]
    )
    assert trained, printed.out
    # The losses are the ones the loop logged (its whole output is kept in the log directory).
    log = (tmp_path / "logs" / "tiny.log").read_text()
    assert LoopRun(argv=[], returncode=0, output=log).losses == {
        1: float(trained.group(1)),
        2: float(trained.group(2)),
    }
    assert re.fullmatch(r"refused  bad ep  megatron_ext: invalid arguments: .+", lines[1]), lines
    assert re.fullmatch(
        r"idle     again   nothing trained: the checkpoint loaded is at iteration 2, "
        r"--train-iters is 2  \(\d+\.\d s\)", lines[2]
    ), lines  # fmt: skip
    assert lines[3:] == ["rehearse: 1/3 configurations trained"]


def test_rehearse_options_after_the_file_are_refused(tmp_path):
    path = _write(tmp_path, "a: --lr 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli.command", "rehearse", path, "--nproc", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--nproc after FILE" in proc.stderr, proc.stderr


def test_example_flags_are_what_the_script_launches(tmp_path):
    import os
    from pathlib import Path

    env = {**os.environ, "DATA": "/data dir"}
    flags = rehearse.example_flags(ROOT / "examples" / "cpu_demo.sh", env, ["--train-iters", "2"])
    assert flags[0] == "--cpu" and flags[-2:] == ["--train-iters", "2"]
    at = flags.index("--data-path")
    assert flags[at + 1] == "/data dir/corpus_text_document"  # quoting kept
    script = tmp_path / "launch.sh"
    script.write_text('exec "$PYTHON" -m megatron_ext.pretrain_gpt --a "b c" "$@" --dry-run\n')
    assert rehearse.example_flags(Path(script), env, ["--d"]) == ["--a", "b c", "--d"]
    script.write_text('echo "DATA is not set" >&2; exit 2\n')
    with pytest.raises(RuntimeError, match="DATA is not set"):
        rehearse.example_flags(Path(script), env)
