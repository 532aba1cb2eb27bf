"""The registry of megatron_ext feature configs and the flag-name rule (no feature imported here).

A feature config is ``@feature_config("title")`` above ``@dataclass(frozen=True, kw_only=True)``; it lives
beside its feature (``megatron_ext/<feature>/config.py``) and :mod:`megatron_ext.training.feature_configs` imports them all.
"""

import dataclasses
from collections.abc import Callable
from typing import TypeVar

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
        if not (params.frozen and params.kw_only):
            raise TypeError(f"{cls.__name__} must be @dataclass(frozen=True, kw_only=True)")
        FEATURE_CONFIGS[cls] = title
        return cls

    return register


def flag(field_name: str) -> str:
    """Returns the command-line flag of a config field: ``pad_policy`` -> ``--pad-policy``."""
    return "--" + field_name.replace("_", "-")
