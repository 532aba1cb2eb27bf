"""The registry of megatron_ext feature configs and the flag-name rule (no feature imported here).

A feature config is ``@feature_config("title")`` above ``@dataclass(frozen=True, kw_only=True)`` in
``megatron_ext/<feature>/config.py``; :mod:`megatron_ext.training.feature_configs` imports them all.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from megatron_ext.config.megatron_view import field_default

_C = TypeVar("_C")

#: Registered feature configs in declaration order, with the title of their argument group.
FEATURE_CONFIGS: dict[type, str] = {}


def feature_config(title: str) -> Callable[[type[_C]], type[_C]]:
    """Registers a frozen, keyword-only dataclass as a megatron_ext feature config.

    Args:
        title: Title of the argument group its flags appear under in ``--help``.
    """

    def register(cls: type[_C]) -> type[_C]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to be a feature config")
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        # Frozen: a config is read by many checks and none may change it; keyword-only: its flags
        # are built from field names, never from positions.
        if not (params.frozen and params.kw_only):
            raise TypeError(f"{cls.__name__} must be @dataclass(frozen=True, kw_only=True)")
        FEATURE_CONFIGS[cls] = title
        return cls

    return register


def flag(field_name: str) -> str:
    """Returns the command-line flag of a config field: ``pad_policy`` -> ``--pad-policy``."""
    return "--" + field_name.replace("_", "-")


def flag_value(args: Any, name: str) -> Any:
    """megatron_ext's flag ``name`` (a registered config's field) as set on Megatron's ``args``,
    unvalidated; where ``args`` lacks it (a hand-built namespace), the field's default.
    """
    # For the checks that run before the feature configs are built (``--cpu``'s) or are handed only
    # Megatron's arguments (Megatron's print hooks, a feature reading another's flag). The one
    # default is the config field's, as MegatronView has one for each Megatron flag.
    fields = [
        f for cls in FEATURE_CONFIGS for f in dataclasses.fields(cls) if f.name == name and f.init
    ]
    assert len(fields) == 1, f"{name} is not the field of one registered feature config"
    # The one read of megatron_ext's own flags off Megatron's namespace (not Megatron's: no view).
    return getattr(args, name, field_default(fields[0]))
