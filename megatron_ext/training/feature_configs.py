"""One frozen dataclass per megatron_ext feature; each field's docstring is its flag's help.

Flags are derived mechanically by Megatron's own ``ArgumentGroupFactory``: field ``pad_policy`` becomes
``--pad-policy`` with the docstring under the field as help, one argument group per feature (see
:mod:`megatron_ext.training.arguments`). The model, dataset and MoE code receives these dataclasses;
Megatron's ``args`` reach only the argument checks (each feature's ``check_megatron_args``,
:mod:`megatron_ext.training.launch_rules`) and the callbacks Megatron hands them to (the providers,
the forward step, its print hooks), and those read Megatron's flags through
:class:`~megatron_ext.config.megatron_view.MegatronView` and megatron_ext's own through these
configs (or :func:`~megatron_ext.config.registry.flag_value`, where no config is built yet).

Rules for a feature config:
- ``@feature_config("title")`` above ``@dataclass(frozen=True, kw_only=True)``.
- Types Megatron's factory understands: bool, int, float, str, Optional[x], list[x], Literal[...].
- ``__post_init__`` raises ``ValueError`` naming the flag (``--pad-policy``).
- Optional ``check_megatron_args(self, args)`` validates the feature against the Megatron flags it reads and
  raises ``ValueError`` naming both flags; it runs at argument time. Rules spanning features live in
  :mod:`megatron_ext.training.launch_rules`, which runs every check once.

Each feature's class lives beside its feature (``megatron_ext/<feature>/config.py``) and registers itself
in :mod:`megatron_ext.config.registry` when imported; this module imports them all, so
``from megatron_ext.training.feature_configs import PaddingConfig`` works and the registry order
(data, moe, replay, entry, rl) is stable.

Config modules must not use ``from __future__ import annotations``: the factory reads real type objects.
"""

from megatron_ext.config.registry import FEATURE_CONFIGS, feature_config, flag

# Importing a feature config registers it; this order is the order of the --help groups.
from megatron_ext.data.config import PaddingConfig
from megatron_ext.moe.config import MoEAlignmentConfig, MoEPadRoutingConfig
from megatron_ext.replay.config import ReplayConfig
from megatron_ext.training.config import EntryConfig
from megatron_ext.training.policy_config import PolicyLossConfig

__all__ = [
    "FEATURE_CONFIGS",
    "EntryConfig",
    "MoEAlignmentConfig",
    "MoEPadRoutingConfig",
    "PaddingConfig",
    "PolicyLossConfig",
    "ReplayConfig",
    "feature_config",
    "flag",
]
