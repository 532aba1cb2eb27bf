"""What fills a sample's pads: the fields both Megatron dataset configs carry, declared once (pure
Python; never imports megatron)::

    PackedDatasetConfig(**gpt_kwargs, **PadFillFields.values_of(padding), ...)
"""

import dataclasses
from typing import Any

from megatron_ext.data.padding import PadPolicy, check_pad_policy


# The dataset configs are Megatron GPTDatasetConfig subclasses (mutable dataclasses) and
# PaddingConfig is a frozen feature config whose fields are the flags; dataclasses cannot mix
# frozen and mutable bases, so the dataset side inherits these fields and takes their values from
# PaddingConfig by name. A test keeps each field's type and default equal to the flag's.
@dataclasses.dataclass(kw_only=True)
class PadFillFields:
    """Pad content of a dataset config (set from ``--pad-policy``, ``--pad-constant-id``,
    ``--multimodal-placeholder-ids``)."""

    pad_policy: PadPolicy = "self"
    """'self' or 'constant' (see megatron_ext.data.padding)."""
    pad_constant_id: int = 0
    """Id of constant pads."""
    multimodal_placeholder_ids: list[int] = dataclasses.field(default_factory=list)
    """Samples containing one of these pad with pad_constant_id."""

    def check_pad_fill(self) -> None:
        """ValueError naming the flag for a pad policy the padder would refuse."""
        check_pad_policy(self.pad_policy)

    @classmethod
    def values_of(cls, padding: Any) -> dict[str, Any]:
        """These fields' values in ``padding`` (a ``PaddingConfig``), lists copied."""
        values = {f.name: getattr(padding, f.name) for f in dataclasses.fields(cls)}
        values["multimodal_placeholder_ids"] = list(values["multimodal_placeholder_ids"])
        return values
