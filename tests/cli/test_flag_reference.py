"""Tier: Megatron on one rank (its real argument parser; no process group).

docs/flags.md is exactly what ``megatron-ext flags --markdown`` prints, and that lists every flag
megatron_ext adds to Megatron's parser, under the title its feature dataclass declares, with the field
docstring as help. After changing a feature config: ``megatron-ext flags --markdown > docs/flags.md``.
"""

import dataclasses
from pathlib import Path

from megatron_ext.cli.command import main
from megatron_ext.cli.flag_reference import markdown
from megatron_ext.training import feature_configs as config
from megatron_ext.training.arguments import megatron_ext_option_strings

DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def test_docs_flags_md_is_the_generated_reference(capsys) -> None:
    assert main(["flags", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == markdown()
    assert DOC.read_text() == printed, "regenerate: megatron-ext flags --markdown > docs/flags.md"


def test_reference_lists_every_flag_under_its_feature_title() -> None:
    text = markdown()
    options = megatron_ext_option_strings()
    assert len(options) >= 20  # the registry was populated
    for option in options:
        assert f"`{option}" in text or f", {option}" in text, option
    for cls, title in config.FEATURE_CONFIGS.items():
        section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        for field in dataclasses.fields(cls):
            flag = config.flag(field.name)
            if field.default is True:  # Megatron's factory: a switch that is on is --no-<name>
                flag = "--no-" + flag[2:]
            start = f"- `{flag}"
            line = next(ln for ln in section.splitlines() if ln.startswith(start))
            assert len(line.split(": ", 1)[1]) > 10, line  # the field docstring is its help


def test_plain_text_lists_the_same_flags(capsys) -> None:
    assert main(["flags"]) == 0
    printed = capsys.readouterr().out
    assert printed and all(opt in printed for opt in megatron_ext_option_strings())
    assert "## " not in printed
