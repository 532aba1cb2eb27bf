"""Tier: subprocesses (a wheel built from this checkout, installed in a fresh venv, run from elsewhere).

The wheel is built with the project's own setuptools (``pip wheel --no-build-isolation``, no network)
from a copy of the files it is made of, and installed with ``--no-deps`` into a new venv that sees the
project environment's site-packages for torch and megatron-core only (a plain path line in a ``.pth``,
so that environment's editable megatron_ext is never activated). Every command runs with
``PYTHONPATH`` unset and the working directory outside the checkout, and the first test proves that
``megatron_ext`` is imported from the venv: whatever the commands need beyond torch/Megatron (tools,
example scripts, the corpus) must therefore be inside the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from megatron_ext.shipped_files import TOOL_SCRIPTS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "megatron_ext", source / "megatron_ext",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for kind, pattern in (("tools", "*.py"), ("examples", "*.sh")):
        (source / kind).mkdir()
        for path in (ROOT / kind).glob(pattern):
            shutil.copy(path, source / kind / path.name)
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"),
         str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "dist").glob("megatron_ext-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "zz_project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(
        [*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return {"venv": venv, "python": python, "purelib": Path(purelib), "cwd": elsewhere, "env": env}


def _run(installed: dict, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
        cwd=installed["cwd"], env=installed["env"],
    )  # fmt: skip


def test_the_package_is_the_installed_wheel_not_the_checkout(installed) -> None:
    done = _run(installed, installed["python"], "-c",
                "import json, megatron_ext, sys; print(megatron_ext.__file__); "
                "print(json.dumps(sys.path))")  # fmt: skip
    assert done.returncode == 0, done.stderr
    location, path = done.stdout.splitlines()
    assert Path(location).is_relative_to(installed["purelib"])
    # No entry is the checkout (the project venv's site-packages may lie inside it: .venv/).
    entries = [Path(entry or installed["cwd"]).resolve() for entry in json.loads(path)]
    assert ROOT.resolve() not in entries, entries
    shipped = installed["purelib"] / "megatron_ext"
    for name in ("_tools/preprocess_data.py", "_examples/cpu_demo.sh", "assets/corpus.jsonl"):
        assert (shipped / name).is_file(), name
    assert (installed["purelib"] / "megatron_ext-0.1.0.dist-info/licenses/LICENSE").is_file()


def test_help_flags_and_a_tool_run_from_the_wheel(installed, tmp_path) -> None:
    command = installed["venv"] / "bin" / "megatron-ext"
    done = _run(installed, command, "--help")
    assert done.returncode == 0, done.stderr
    for sub in ("demo", "flags", "rehearse", *TOOL_SCRIPTS):
        assert sub in done.stdout
    done = _run(installed, command, "flags", "--markdown")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (ROOT / "docs/flags.md").read_text()
    corpus = installed["purelib"] / "megatron_ext/assets/corpus.jsonl"
    prefix = tmp_path / "corpus_text_document"
    done = _run(installed, command, "preprocess-data", "--input", corpus, "--output-prefix", prefix,
                "--append-eod")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert prefix.with_suffix(".bin").stat().st_size > 0 and prefix.with_suffix(".idx").is_file()
    # The shipped example validates every flag against Megatron's parser and the installed package.
    script = installed["purelib"] / "megatron_ext/_examples/cpu_demo.sh"
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=600, cwd=installed["cwd"],
        env={**installed["env"], "DRY_RUN": "1", "DATA": str(tmp_path),
             "PYTHON": str(installed["python"])},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_demo_runs_from_the_wheel(installed, tmp_path) -> None:
    out = tmp_path / "demo.json"
    done = _run(installed, installed["venv"] / "bin" / "megatron-ext", "demo", "--steps", "2",
                "--json", out, "--png", tmp_path / "load.png", timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[FAILED]" not in done.stdout and "[ok] replay reproduces" in done.stdout
    assert out.stat().st_size > 0 and list(installed["cwd"].iterdir()) == []
