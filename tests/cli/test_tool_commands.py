"""Tier: pure (files; the tools run in-process through ``megatron-ext <tool>``).

The tools as ``megatron-ext`` subcommands: every script in tools/ has one, each runs the script's own
``main()`` as its ``__main__`` block does, with the same output, errors and exit status; the shipped
files are found in the checkout (an installed wheel is tests/test_wheel.py).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.cli.command import main
from megatron_ext.cli.tool_commands import tool_command
from megatron_ext.common.shipped_files import TOOL_SCRIPTS, shipped_file

ROOT = Path(__file__).resolve().parents[2]


def test_every_tool_script_has_a_subcommand() -> None:
    scripts = {path.name for path in (ROOT / "tools").glob("*.py")}
    assert scripts and set(TOOL_SCRIPTS.values()) == scripts


@pytest.mark.parametrize("script", sorted(TOOL_SCRIPTS.values()))
def test_subcommand_does_what_the_scripts_main_block_does(script: str) -> None:
    """The subcommand calls ``run_tool(main)``; if a script's ``__main__`` block ever does more, this
    fails and the subcommand must follow."""
    tree = ast.parse(shipped_file("tools", script).read_text())
    blocks = [
        node for node in tree.body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    ]  # fmt: skip
    assert [ast.unparse(b) for b in blocks] == [
        "if __name__ == '__main__':\n    sys.exit(run_tool(main))"
    ]


def test_subcommand_writes_what_the_script_writes(tmp_path) -> None:
    script_out, command_out = tmp_path / "script.jsonl", tmp_path / "command.jsonl"
    flags = ["--docs", "7", "--seed", "3"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools/make_corpus.py"), *flags, "--out", str(script_out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert main(["make-corpus", *flags, "--out", str(command_out)]) == 0
    assert command_out.read_bytes() == script_out.read_bytes() and script_out.stat().st_size > 0


def test_bad_input_is_one_line_named_for_the_subcommand(tmp_path, capsys, monkeypatch) -> None:
    missing = tmp_path / "missing.jsonl"
    monkeypatch.setattr(sys, "argv", ["megatron-ext"])
    argv = ["preprocess-data", "--input", str(missing), "--output-prefix", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"megatron-ext preprocess-data: error: --input {missing} does not exist"
    assert list(tmp_path.iterdir()) == []  # nothing partial written
    assert sys.argv == ["megatron-ext"]  # restored


def test_help_is_the_tools_own_and_other_commands_pass_through(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--verbose", "pack-stats", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: megatron-ext pack-stats") and "--seq-length" in out
    assert tool_command(["demo", "--steps", "2"]) is None and tool_command(["--debug"]) is None


def test_shipped_files_come_from_the_checkout_here() -> None:
    assert shipped_file("examples", "cpu_demo.sh") == ROOT / "examples/cpu_demo.sh"
    with pytest.raises(FileNotFoundError, match="reinstall megatron_ext"):
        shipped_file("tools", "no_such_tool.py")
