"""The pad-fill fields are declared once for both dataset configs and always agree with the flags."""

import dataclasses

import pytest

from megatron_ext.data.gpt_dataset import SelfPaddedGPTDatasetConfig
from megatron_ext.data.packed_dataset import PackedDatasetConfig
from megatron_ext.data.pad_fill import PadFillFields
from megatron_ext.replay.route_dataset import RoutedPackedDatasetConfig
from megatron_ext.training.feature_configs import PaddingConfig


def _default(field: dataclasses.Field) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def test_each_field_has_the_flags_type_and_default() -> None:
    flags = {f.name: f for f in dataclasses.fields(PaddingConfig)}
    fill = dataclasses.fields(PadFillFields)
    assert [f.name for f in fill] == ["pad_policy", "pad_constant_id", "multimodal_placeholder_ids"]
    for field in fill:
        flag = flags[field.name]
        assert field.type == flag.type, field.name
        assert _default(field) == _default(flag), field.name


@pytest.mark.parametrize(
    "config_cls", [SelfPaddedGPTDatasetConfig, PackedDatasetConfig, RoutedPackedDatasetConfig]
)
def test_every_dataset_config_inherits_the_fields_instead_of_declaring_them(config_cls) -> None:
    assert issubclass(config_cls, PadFillFields)
    for name in (f.name for f in dataclasses.fields(PadFillFields)):
        owners = [c for c in config_cls.__mro__ if name in c.__dict__.get("__annotations__", {})]
        assert owners == [PadFillFields], (config_cls.__name__, name, owners)


def test_values_of_reads_the_run_flags_and_copies_the_list() -> None:
    padding = PaddingConfig(
        pad_policy="constant", pad_constant_id=7, multimodal_placeholder_ids=[3, 4]
    )
    values = PadFillFields.values_of(padding)
    assert values == {
        "pad_policy": "constant",
        "pad_constant_id": 7,
        "multimodal_placeholder_ids": [3, 4],
    }
    values["multimodal_placeholder_ids"].append(9)
    assert padding.multimodal_placeholder_ids == [3, 4]


def test_unknown_policy_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--pad-policy 'zeros'"):
        PadFillFields(pad_policy="zeros").check_pad_fill()  # type: ignore[arg-type]
    PadFillFields(pad_policy="constant").check_pad_fill()
