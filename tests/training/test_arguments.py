"""Tier: Megatron on one rank (its real argument parser). Our flags derive from the configs and never clash.

Uses ``megatron.training.arguments.parse_args(extra_args_provider=add_megatron_ext_args)`` from the 0.19.2
wheel, exactly as ``pretrain`` calls it.
"""

import argparse
import dataclasses
import sys
from typing import Literal

import pytest
from megatron.training.arguments import add_megatron_arguments, parse_args

from megatron_ext.training import feature_configs as config
from megatron_ext.training.arguments import (
    add_megatron_ext_args,
    configs_from_args,
    megatron_ext_option_strings,
)


def _parse(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return parse_args(extra_args_provider=add_megatron_ext_args)


def test_every_feature_is_registered_and_flags_exist() -> None:
    assert config.FEATURE_CONFIGS, "no feature config registered"
    options = megatron_ext_option_strings()
    for cls in config.FEATURE_CONFIGS:
        for field in dataclasses.fields(cls):
            kebab = config.flag(field.name)
            assert any(opt.endswith(kebab[2:]) for opt in options), f"{kebab} missing"


def test_no_flag_or_dest_clashes_with_megatron() -> None:
    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    megatron_options = {o for a in megatron._actions for o in a.option_strings}
    megatron_dests = {a.dest for a in megatron._actions}
    assert len(megatron_options) > 500  # really Megatron's parser, not an empty one
    ours = add_megatron_ext_args(argparse.ArgumentParser(add_help=False))
    our_options = {o for a in ours._actions for o in a.option_strings}
    our_dests = {a.dest for a in ours._actions}
    assert not our_options & megatron_options, our_options & megatron_options
    assert not our_dests & megatron_dests, our_dests & megatron_dests


def test_defaults_parse_with_megatrons_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parse([], monkeypatch)
    configs = configs_from_args(args)
    assert set(configs) == set(config.FEATURE_CONFIGS)
    for cls, instance in configs.items():
        assert isinstance(instance, cls)
        # Defaults on the command line equal the dataclass defaults: one source of truth.
        assert instance == cls()


def test_configs_from_args_names_missing_flags() -> None:
    with pytest.raises(ValueError, match="add_megatron_ext_args"):
        configs_from_args(argparse.Namespace())


def test_registry_refuses_mutable_configs() -> None:
    with pytest.raises(TypeError, match="frozen=True, kw_only=True"):

        @config.feature_config("bad")
        @dataclasses.dataclass
        class Mutable:
            x: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyConfig:
    """A feature used only to exercise the flag mechanism itself."""

    toy_mode: Literal["off", "on"] = "off"
    """Whether the toy is on."""
    toy_multiple: int = 1
    """Round things up to this multiple."""

    def __post_init__(self) -> None:
        if self.toy_multiple < 1:
            raise ValueError(f"{config.flag('toy_multiple')} must be >= 1, got {self.toy_multiple}")

    def check_megatron_args(self, args: argparse.Namespace) -> None:
        if self.toy_mode == "on" and args.expert_model_parallel_size > 1:
            raise ValueError("--toy-mode on does not support --expert-model-parallel-size > 1")


@pytest.fixture
def toy_feature():
    """Registers ToyConfig for the duration of one test (module level: Megatron's factory reads its source)."""
    config.feature_config("toy feature")(ToyConfig)
    yield ToyConfig
    del config.FEATURE_CONFIGS[ToyConfig]


def test_toy_flags_parse_with_help_from_docstrings(toy_feature, monkeypatch) -> None:
    args = _parse(["--toy-mode", "on", "--toy-multiple", "16"], monkeypatch)
    assert configs_from_args(args)[toy_feature] == toy_feature(toy_mode="on", toy_multiple=16)
    parser = add_megatron_ext_args(argparse.ArgumentParser())
    assert "Round things up to this multiple." in parser.format_help()


def test_bad_value_error_names_the_flag(toy_feature, monkeypatch) -> None:
    args = _parse(["--toy-multiple", "0"], monkeypatch)
    with pytest.raises(ValueError, match="--toy-multiple must be >= 1, got 0"):
        configs_from_args(args)


def test_bad_choice_is_refused_by_the_parser(toy_feature, monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit):
        _parse(["--toy-mode", "maybe"], monkeypatch)
    assert "--toy-mode" in capsys.readouterr().err


def test_bad_combination_with_megatron_flag(toy_feature, monkeypatch) -> None:
    args = _parse(["--toy-mode", "on", "--expert-model-parallel-size", "2"], monkeypatch)
    with pytest.raises(ValueError, match="--toy-mode on .* --expert-model-parallel-size"):
        configs_from_args(args)


def test_help_prints_with_megatrons_own_flags() -> None:
    """Megatron 0.19.2's parser alone cannot print --help (a docstring-derived help ends in '10%)');
    with megatron_ext's arguments added, every help string expands and the flag is still listed."""
    from megatron_ext.training.arguments import escape_unexpandable_help

    megatron_only = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    try:
        megatron_only.format_help()
    except ValueError:
        broken = True
    else:
        broken = False
    assert broken, "Megatron's help expands now: the escape can go"
    assert escape_unexpandable_help(megatron_only) == ["--moe-paged-stash-buffer-size-factor-cuda"]
    megatron_only.format_help()
    parser = add_megatron_ext_args(add_megatron_arguments(argparse.ArgumentParser()))
    text = parser.format_help()
    assert "megatron_ext:" in text and "--moe-dispatch-align" in text
    assert "10%)" in text  # Megatron's own text, escaped, not dropped
