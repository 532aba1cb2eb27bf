"""The commands the documentation shows: ``bash`` blocks of README.md and docs/*.md, and the commands
in the examples' header comments (``# Command:`` and the labelled lines under it)."""

import re
import shlex
from pathlib import Path

from tests.training.entry_args import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.sh") if not p.name.startswith("_"))
#: Labels of header lines that hold a command (``#   Routes: megatron-ext convert-routes ...``).
HEADER_LABELS = ("Command", "Routes", "Data")


def bash_blocks(path: Path) -> list[str]:
    """Every fenced block tagged ``bash`` (untagged and ``text`` blocks are output or diagrams)."""
    return re.findall(r"^```bash\n(.*?)^```$", path.read_text(), re.MULTILINE | re.DOTALL)


def header_commands(script: Path) -> list[str]:
    """The commands of a script's header comment, backslash continuations joined."""
    commands, current = [], None
    for line in script.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        label = re.match(r"(\w+): (.*)", text)
        if current is not None:
            current += " " + text
        elif label and label.group(1) in HEADER_LABELS:
            current = label.group(2)
        else:
            continue
        if current.endswith("\\"):
            current = current[:-1].rstrip()
        else:
            commands.append(current)
            current = None
    return commands


def launch_env(command: str) -> tuple[dict[str, str], str] | None:
    """``VAR=value ... bash examples/X.sh`` -> (the variables, ``X.sh``); None for other commands."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if len(words) == 2 and words[0] == "bash" and words[1].startswith("examples/"):
        return env, words[1].removeprefix("examples/")
    return None


def normalized(command: str) -> str:
    """A command with its whitespace and line continuations collapsed (to run each one once)."""
    return " ".join(command.replace("\\\n", " ").split())
