"""One frozen dataclass per megatron_ext feature; each field's docstring is its flag's help.

Field ``pad_policy`` becomes ``--pad-policy`` (docs/architecture.md, "A feature's flags", has the
rules for a feature config). The model, dataset and MoE code receives these dataclasses, never
Megatron's ``args``.
"""

from megatron_ext.config.registry import FEATURE_CONFIGS, feature_config, flag

# Importing a feature config registers it; this order (data, moe, replay, entry, rl) is the order
# of the --help groups. Each class lives beside its feature; importing them all here lets
# `from megatron_ext.training.feature_configs import PaddingConfig` work.
from megatron_ext.data.config import PaddingConfig
from megatron_ext.moe.config import MoEAlignmentConfig, MoEPadRoutingConfig
from megatron_ext.replay.config import ReplayConfig
from megatron_ext.training.config import EntryConfig
from megatron_ext.training.policy_config import PolicyLossConfig

# Registration follows import order, which a test or a tool may have changed (importing
# replay.config first): put the groups back in the order above, so --help and docs/flags.md do not
# depend on what was imported first.
for _cls in (
    PaddingConfig,
    MoEAlignmentConfig,
    MoEPadRoutingConfig,
    ReplayConfig,
    EntryConfig,
    PolicyLossConfig,
):
    FEATURE_CONFIGS[_cls] = FEATURE_CONFIGS.pop(_cls)

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
