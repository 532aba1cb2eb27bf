"""megatron_ext's command-line flags, for Megatron's ``extra_args_provider``.

Example::

    from megatron.training import pretrain
    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    args = parse_args(extra_args_provider=add_megatron_ext_args)   # our flags parse with Megatron's
    cfgs = configs_from_args(args)                                # frozen dataclasses, validated
    cfgs[PaddingConfig].pad_policy
"""

import argparse
from typing import Any

from megatron_ext.training import feature_configs as _config


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds one argument group per megatron_ext feature to Megatron's parser and returns it.

    Usable directly as ``extra_args_provider`` of ``megatron.training.pretrain`` / ``parse_args``.
    """
    from megatron.training.argument_utils import ArgumentGroupFactory

    # Megatron's own factory (-- + kebab-case field name, help = the field's docstring, one group
    # per feature), so our flags look and parse exactly like Megatron's.
    for cls, title in _config.FEATURE_CONFIGS.items():
        ArgumentGroupFactory(cls).build_group(parser, title=f"megatron_ext: {title}")
    escape_unexpandable_help(parser)
    return parser


def escape_unexpandable_help(parser: argparse.ArgumentParser) -> list[str]:
    """Escapes ``%`` in the help strings argparse cannot expand; returns the flags fixed."""
    # Megatron derives help from config docstrings, and 0.19.2's text for
    # --moe-paged-stash-buffer-size-factor-cuda ends in "10%)": argparse reads that as a format
    # directive, so --help raised ValueError instead of printing. Only strings that fail to expand
    # are touched (their %(default)s-style directives were unusable anyway).
    formatter = parser._get_formatter()
    fixed = []
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, KeyError, TypeError):
            action.help = action.help.replace("%", "%%")
            fixed.append(action.option_strings[0] if action.option_strings else action.dest)
    return fixed


def configs_from_args(args: argparse.Namespace) -> dict[type, Any]:
    """Builds every feature config from parsed arguments and validates them against Megatron's.

    Args:
        args: The namespace from ``megatron.training.arguments.parse_args`` (or any parser that ran
            :func:`add_megatron_ext_args`).

    Returns:
        ``{ConfigClass: instance}`` for every registered feature.

    Raises:
        ValueError: A flag's value, or a combination with Megatron's own flags, is not supported; the
            message names the flag(s).
    """
    from megatron_ext.training.launch_rules import validate

    return validate(args)


def megatron_ext_option_strings() -> set[str]:
    """Every option string megatron_ext adds (``--pad-policy``, ``--no-...``), for clash checks."""
    parser = add_megatron_ext_args(argparse.ArgumentParser(add_help=False))
    return {opt for action in parser._actions for opt in action.option_strings}
