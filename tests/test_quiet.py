"""Tier: subprocesses. Tools hide only the warnings that do not apply; --verbose shows them (so the quiet
default provably hides something)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_APPLICABLE = "Transformer Engine and Apex are not installed"


TOOLS = ("preprocess_data", "pack_stats", "convert_routes")


def _help(tool: str, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / f"tools/{tool}.py"), "--help", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_tools_are_quiet_by_default_and_verbose_shows_everything():
    """Every tool that imports Megatron hides its import warnings (each imports megatron_ext's
    filters before Megatron); --verbose shows them, so the quiet default hides something."""
    runs = [(tool, ()) for tool in TOOLS] + [("pack_stats", ("--verbose",))]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two interpreters, one per core
        *quiet, verbose = pool.map(lambda run: _help(run[0], *run[1]), runs)
    for tool, stderr in zip(TOOLS, quiet, strict=True):
        assert NOT_APPLICABLE not in stderr, (tool, stderr[-2000:])
    assert NOT_APPLICABLE in verbose


def test_real_warnings_still_show():
    import warnings

    from megatron_ext.quiet import quiet_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_warnings()  # the filters sit on top of "default"
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", stacklevel=1)
        warnings.warn("something the user must see", stacklevel=1)
    assert [str(w.message) for w in caught] == ["something the user must see"]
