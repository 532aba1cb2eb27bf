"""One frozen dataclass per megatron_ext feature; each field's docstring is its flag's help.

Flags are derived mechanically by Megatron's own ``ArgumentGroupFactory``: field ``pad_policy`` becomes
``--pad-policy`` with the docstring under the field as help, one argument group per feature (see
:mod:`megatron_ext.arguments`). Code below ``arguments.py`` receives these dataclasses, never ``args``.

Rules for a feature config:
- ``@feature_config("title")`` above ``@dataclass(frozen=True, kw_only=True)``.
- Types Megatron's factory understands: bool, int, float, str, Optional[x], list[x], Literal[...].
- ``__post_init__`` raises ``ValueError`` naming the flag (``--pad-policy``).
- Optional ``check_megatron_args(self, args)`` validates combinations with Megatron's own arguments and raises
  ``ValueError`` naming both flags; it runs at argument time.

This module must not use ``from __future__ import annotations``: the factory reads real type objects.
"""

import dataclasses
from typing import Callable, TypeVar

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


# === data (issue 3) ===

# === moe (issue 4) ===

# === replay (issue 5) ===
