"""The ``launch`` benchmark: what it launches, and its rounds and ratios on stand-in commands.

Tier: pure + subprocesses (the real launch is timed by ``megatron-ext bench --only launch``).
"""

import sys

import pytest

from megatron_ext.bench import launch
from megatron_ext.bench.registry import discover


@pytest.fixture(autouse=True)
def no_corpus(monkeypatch):
    """The stand-in commands below read no corpus: the real one's preprocessing (a fresh
    interpreter, seconds) is what ``make bench-quick`` runs, before its real launch."""
    written = []
    monkeypatch.setattr(launch, "_write_corpus", written.append)
    return written


def test_registered_and_times_a_tiny_cpu_launch_against_the_import():
    assert discover()["launch"] is launch.launch_overhead
    commands = launch._commands("/data/prefix")
    run = commands["launch"]
    assert run[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    at = run.index("-m", 2)
    assert run[at + 1] == "megatron_ext.pretrain_gpt" and "--cpu" in run
    assert run[-4:] == ["--data-path", "/data/prefix", "--train-iters", "3"]
    assert commands["import"][1:] == ["-c", "import megatron.training.training"]


def test_rounds_pair_each_launch_with_its_import(monkeypatch, no_corpus):
    sleeps = {"launch": 0.3, "import": 0.1}
    prefixes = []

    def commands(prefix):
        prefixes.append(prefix)
        return {
            k: [sys.executable, "-c", f"import time; time.sleep({s})"] for k, s in sleeps.items()
        }

    monkeypatch.setattr(launch, "_commands", commands)
    result = launch.launch_overhead(quick=True)
    assert no_corpus == prefixes and len(prefixes) == 1  # the launch reads the corpus written
    seconds = result.extra["seconds"]
    assert result.extra["rounds"] == 1 and {k: len(v) for k, v in seconds.items()} == {
        "launch": 1,
        "import": 1,
    }
    name, low, median, ratio, ratio_min, ratio_max = result.rows[0]
    assert name == "launch" and ratio_min <= ratio <= ratio_max
    assert ratio == pytest.approx(seconds["launch"][0] / seconds["import"][0])  # one round's pair
    assert low == median == seconds["launch"][0]
    assert ratio > 1.2  # a 0.3 s command plus start-up over a 0.1 s one


def test_a_failing_command_raises_with_its_output(monkeypatch):
    monkeypatch.setattr(
        launch,
        "_commands",
        lambda prefix: {
            "launch": [sys.executable, "-c", "print('why it failed'); raise SystemExit(3)"],
            "import": [sys.executable, "-c", "pass"],
        },
    )
    with pytest.raises(RuntimeError, match=r"failed \(3\):\nwhy it failed"):
        launch.launch_overhead(quick=True)


def test_cpu_seconds_are_the_process_trees_own_and_paired_by_round(monkeypatch):
    """A command that burns CPU in a child of its own vs one that sleeps as long: the wall times
    are alike, the CPU seconds are not, and the child's CPU is counted."""
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}], check=True)"
    monkeypatch.setattr(
        launch,
        "_commands",
        lambda prefix: {
            "launch": [sys.executable, "-c", child],
            "import": [sys.executable, "-c", "import time; time.sleep(0.4)"],
        },
    )
    result = launch.launch_overhead(quick=True)
    (table,) = result.tables
    cpu = result.extra["cpu_seconds"]
    assert table.columns == result.columns
    assert [row[0] for row in table.rows] == ["launch", "import"]
    assert cpu["launch"][0] >= 0.4  # the grandchild's burn is in it
    assert cpu["import"][0] < cpu["launch"][0] - 0.3  # sleeping costs no CPU
    assert table.rows[0][3] == pytest.approx(cpu["launch"][0] / cpu["import"][0])
