"""Tier: subprocesses. Tools hide only the warnings that do not apply; --verbose shows them (so the quiet
default provably hides something)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_APPLICABLE = "Transformer Engine and Apex are not installed"


#: Each tool with flags that parse and then stop at the first thing that needs Megatron's
#: IndexedDataset (their --help imports no Megatron at all: tests/cli/test_command.py): a missing input,
#: refused in one line with exit status 2, after Megatron's import warnings would have shown.
RUNS = {
    "preprocess_data": ["--input", "{tmp}/missing.jsonl", "--output-prefix", "{tmp}/out"],
    "pack_stats": ["--data-path", "{tmp}/missing", "--seq-length", "8"],
    "merge_datasets": ["--input-prefixes", "{tmp}/missing", "--output-prefix", "{tmp}/merged"],
}


def _stderr(tool: str, tmp: Path, *extra: str) -> str:
    args = [a.replace("{tmp}", str(tmp)) for a in RUNS[tool]]
    # -X importtime lists every import on stderr: the quiet run's own proof that it imported
    # Megatron (and so had its warnings to hide).
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / f"tools/{tool}.py"), *args, *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert "missing" in said[-1], proc.stderr[-2000:]  # the one-line refusal
    return proc.stderr


def test_tools_are_quiet_by_default_and_verbose_shows_everything(tmp_path):
    """Every tool that imports Megatron hides its import warnings (each imports megatron_ext's
    filters before Megatron): each quiet run imported the module that warns (its -X importtime
    lines say so) and shows no warning; --verbose shows them (the same import, one tool: the
    warnings are Megatron's, not the tool's)."""
    runs = [(tool, ()) for tool in RUNS] + [("preprocess_data", ("--verbose",))]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two interpreters, one per core
        stderrs = list(pool.map(lambda run: _stderr(run[0], tmp_path, *run[1]), runs))
    for (tool, extra), stderr in zip(runs, stderrs, strict=True):
        imported = [line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines()
                    if line.startswith("import time:")]  # fmt: skip
        assert "megatron.core.optimizer" in imported, (tool, stderr[-2000:])  # it warns
        assert (NOT_APPLICABLE in stderr) == bool(extra), (tool, extra, stderr[-2000:])


def test_real_warnings_still_show():
    import warnings

    from megatron_ext.common.quiet import quiet_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_warnings()  # the filters sit on top of "default"
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", stacklevel=1)
        warnings.warn("something the user must see", stacklevel=1)
    assert [str(w.message) for w in caught] == ["something the user must see"]
