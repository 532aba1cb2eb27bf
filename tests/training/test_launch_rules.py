"""Tier: Megatron's argument parser on one process (``parse_args``, then ``validate``).

A launch runs each argument-time check once, in one order (``--cpu`` first, the launch's cheap
checks, each feature, the vocabulary, the combinations), and the providers' later request for the
configs of the same arguments runs nothing again; a check that refuses stops the ones after it.
"""

import sys

import pytest

from tests.training.entry_args import BASE_ARGS

#: (module, function) of every check the one validation path runs besides the features' own.
CHECKS = (
    ("megatron_ext.training.cpu_args", "check_cpu_args"),
    ("megatron_ext.training.launch_args", "check_launch_args"),
    ("megatron_ext.training.eval_args", "check_split"),
    ("megatron_ext.training.eval_args", "check_evaluation_data"),
    ("megatron_ext.training.vocab_check", "check_vocabulary"),
    ("megatron_ext.training.launch_rules", "check_combinations"),
)


def _counted(monkeypatch, calls: list[str]) -> None:
    import importlib

    for module_name, name in CHECKS:
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def check(args, _name=name, _original=original) -> None:
            calls.append(_name)
            _original(args)

        monkeypatch.setattr(module, name, check)


def _cpu_args(monkeypatch, *extra: str):
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args

    argv = ["pretrain_gpt", *BASE_ARGS, "--cpu", "--distributed-backend", "gloo", "--mock-data"]
    expert = ["--expert-model-parallel-size", "1"]  # one process: the grid check passes
    monkeypatch.setattr(sys, "argv", [*argv, *expert, "--eval-interval", "2", *extra])
    return parse_args(extra_args_provider=add_megatron_ext_args)


def test_a_launch_runs_each_check_once_and_the_providers_reuse_its_configs(monkeypatch) -> None:
    from megatron_ext.training.arguments import configs_from_args
    from megatron_ext.training.feature_configs import PaddingConfig
    from megatron_ext.training.launch_rules import validate

    calls: list[str] = []
    _counted(monkeypatch, calls)
    args = _cpu_args(monkeypatch)
    configs = validate(args, launch=True)
    assert calls == [name for _, name in CHECKS]
    assert configs_from_args(args) is configs  # what run_state asks for the same arguments
    assert calls == [name for _, name in CHECKS]
    assert isinstance(configs[PaddingConfig], PaddingConfig)


def test_outside_a_launch_the_configs_path_checks_cpu_and_combinations_but_not_the_launch(
    monkeypatch,
) -> None:
    from megatron_ext.training.arguments import configs_from_args

    calls: list[str] = []
    _counted(monkeypatch, calls)
    args = _cpu_args(monkeypatch)
    configs_from_args(args)
    configs_from_args(args)  # not a launch: nothing remembered, every check runs again
    once = ["check_cpu_args", "check_vocabulary", "check_combinations"]
    assert calls == once + once


def test_cpu_is_refused_before_the_launch_checks(monkeypatch) -> None:
    from megatron_ext.training.launch_rules import validate

    calls: list[str] = []
    _counted(monkeypatch, calls)
    args = _cpu_args(monkeypatch, "--bf16", "--context-parallel-size", "2")
    with pytest.raises(ValueError, match="--cpu cannot run --bf16"):
        validate(args, launch=True)
    assert calls == ["check_cpu_args"]
