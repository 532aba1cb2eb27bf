"""Tier: subprocesses (a wheel built from this checkout, installed in a fresh venv, run from elsewhere).

How the wheel is built and installed: tests/installed_wheel.py (the session's ``installed``
fixture). Every command runs with ``PYTHONPATH`` unset and the working directory outside the
checkout, and the first test proves that ``megatron_ext`` is imported from the venv: whatever the
commands need beyond torch/Megatron (tools, example scripts, the corpus) must therefore be inside
the wheel. The demo is run once from the wheel (the ``wheel_demo`` fixture); its checks are
tests/rehearse/test_demo.py's.
"""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_ext.common.shipped_files import TOOL_SCRIPTS
from tests.installed_wheel import ROOT

pytestmark = pytest.mark.slow


def test_the_package_is_the_installed_wheel_not_the_checkout(installed) -> None:
    done = installed.run(installed.python, "-c",
                "import json, megatron_ext, sys; print(megatron_ext.__file__); "
                "print(json.dumps(sys.path))")  # fmt: skip
    assert done.returncode == 0, done.stderr
    location, path = done.stdout.splitlines()
    assert Path(location).is_relative_to(installed.purelib)
    # No entry is the checkout (the project venv's site-packages may lie inside it: .venv/).
    entries = [Path(entry or installed.cwd).resolve() for entry in json.loads(path)]
    assert ROOT.resolve() not in entries, entries
    shipped = installed.purelib / "megatron_ext"
    for name in ("_tools/preprocess_data.py", "_examples/cpu_demo.sh", "assets/corpus.jsonl"):
        assert (shipped / name).is_file(), name
    assert (installed.purelib / "megatron_ext-0.1.0.dist-info/licenses/LICENSE").is_file()


def test_help_flags_and_a_tool_run_from_the_wheel(installed, tmp_path) -> None:
    command = installed.venv / "bin" / "megatron-ext"
    # The help and the flag reference beside the tool and the dry run (which reads its output):
    # each is one fresh interpreter, and the machine has 2 cores.
    with ThreadPoolExecutor(max_workers=1) as beside:
        helps = beside.submit(
            lambda: [
                installed.run(command, "--help"),
                installed.run(command, "flags", "--markdown"),
            ]
        )
        _run_the_tool_and_the_example(installed, command, tmp_path)
        done, flags = helps.result()
    assert done.returncode == 0, done.stderr
    for sub in ("demo", "flags", "rehearse", *TOOL_SCRIPTS):
        assert sub in done.stdout
    assert flags.returncode == 0, flags.stderr
    assert flags.stdout == (ROOT / "docs/flags.md").read_text()


def _run_the_tool_and_the_example(installed, command, tmp_path) -> None:
    corpus = installed.purelib / "megatron_ext/assets/corpus.jsonl"
    prefix = tmp_path / "corpus_text_document"
    done = installed.run(command, "preprocess-data", "--input", corpus, "--output-prefix", prefix,
                "--append-eod")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert prefix.with_suffix(".bin").stat().st_size > 0 and prefix.with_suffix(".idx").is_file()
    # The shipped example validates every flag against Megatron's parser and the installed package.
    script = installed.purelib / "megatron_ext/_examples/cpu_demo.sh"
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=600, cwd=installed.cwd,
        env={**installed.env, "DRY_RUN": "1", "DATA": str(tmp_path),
             "PYTHON": str(installed.python)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_demo_runs_from_the_wheel(wheel_demo) -> None:
    assert wheel_demo.returncode == 0, wheel_demo.stdout[-3000:] + wheel_demo.stderr[-3000:]
    assert "[FAILED]" not in wheel_demo.stdout
    assert "[ok] replay at context parallelism 1 reproduces" in wheel_demo.stdout
    assert wheel_demo.summary and wheel_demo.cwd_after == []
