"""A wheel built from this checkout, installed in a fresh venv, and the demo run once from it.

For tests/test_wheel.py (the package works from the wheel alone) and tests/rehearse/test_demo.py
(the demo's checks): both read the one demo run :func:`run_demo` makes, as a user runs it
(``megatron-ext demo`` from the venv, outside the checkout), so the suite trains the demo's four
launches once.

The wheel is built with the project's own setuptools (``pip wheel --no-build-isolation``, no network)
from a copy of the files it is made of, and installed with ``--no-deps`` into a new venv that sees the
project environment's site-packages for torch and megatron-core only (a plain path line in a ``.pth``,
so that environment's editable megatron_ext is never activated). Every command runs with
``PYTHONPATH`` unset and the working directory outside the checkout: whatever the commands need
beyond torch/Megatron (tools, example scripts, the corpus) must therefore be inside the wheel.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Iterations of each demo launch (test_demo.py checks 3 logged losses).
DEMO_STEPS = 3


@dataclass(frozen=True)
class Installed:
    venv: Path
    python: Path
    purelib: Path
    cwd: Path  # an empty directory outside the checkout: every command's working directory
    env: dict[str, str]

    def run(self, *argv: object, timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
            cwd=self.cwd, env=self.env,
        )  # fmt: skip


def install_wheel(base: Path) -> Installed:
    """Builds the wheel from a copy of the checkout's packaged files and installs it in a new venv."""
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
    # Without the caller's PYTHONPATH: a checkout on it (``PYTHONPATH=$PWD pytest``) puts its
    # megatron_ext.egg-info on pip's path, and pip then skips the install as already satisfied.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"),
         str(source)],
        capture_output=True, text=True, timeout=600, env=clean,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "dist").glob("megatron_ext-*.whl")
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=clean
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=clean,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "zz_project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(
        [*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=600, env=clean,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    env = dict(clean)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return Installed(venv=venv, python=python, purelib=Path(purelib), cwd=elsewhere, env=env)


@dataclass(frozen=True)
class DemoRun:
    """``megatron-ext demo --steps DEMO_STEPS --json --png --workdir`` as the wheel ran it."""

    returncode: int
    stdout: str
    stderr: str
    summary: dict
    png: Path
    workdir: Path
    cwd_after: list[Path]  # what the demo left in its working directory


def run_demo(installed: Installed, out: Path) -> DemoRun:
    """The demo from the wheel's ``megatron-ext`` command, its files under ``out``."""
    summary, png, workdir = out / "demo.json", out / "load.png", out / "work"
    done = installed.run(installed.venv / "bin" / "megatron-ext", "demo",
                         "--steps", DEMO_STEPS, "--json", summary, "--png", png,
                         "--workdir", workdir, timeout=1800)  # fmt: skip
    return DemoRun(
        returncode=done.returncode,
        stdout=done.stdout,
        stderr=done.stderr,
        summary=json.loads(summary.read_text()) if summary.is_file() else {},
        png=png,
        workdir=workdir,
        cwd_after=list(installed.cwd.iterdir()),
    )
