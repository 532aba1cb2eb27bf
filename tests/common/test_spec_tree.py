"""Tests for megatron_ext.common.spec_tree. Tier: in process (Megatron's real layer specs, no ranks)."""

import dataclasses
import functools

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.common.spec_tree import map_spec, spec_parts


class _Stand(DotProductAttention):
    """A stand-in class to swap in."""


def _swap(old: type, new: type):
    return lambda part: new if part is old else part


def test_every_reference_is_replaced_and_the_rest_is_the_same_object() -> None:
    spec = get_gpt_layer_local_spec(num_experts=8)
    assert DotProductAttention in spec_parts(spec)  # the interesting case: it is in there
    swapped = map_spec(spec, _swap(DotProductAttention, _Stand))
    parts = spec_parts(swapped)
    assert DotProductAttention not in parts and _Stand in parts
    assert DotProductAttention in spec_parts(spec)  # the original spec is not changed
    # The MLP's spec holds no attention: returned as the same object.
    assert swapped.submodules.mlp is spec.submodules.mlp
    assert swapped.submodules.self_attention is not spec.submodules.self_attention
    # Nothing to replace: the whole spec comes back as it was.
    assert map_spec(spec, _swap(type("Absent", (), {}), _Stand)) is spec


def test_partials_lists_tuples_and_dicts_are_walked_and_kept_when_unchanged() -> None:
    leaf = ModuleSpec(module=DotProductAttention)
    other = ModuleSpec(module=int)
    tree = {
        "factory": functools.partial(dict, leaf, key=[other, (leaf,)]),
        "kept": [other, (other,)],
    }
    out = map_spec(tree, _swap(DotProductAttention, _Stand))
    factory = out["factory"]
    assert factory.func is dict and factory.args[0].module is _Stand
    assert factory.keywords["key"][0] is other and factory.keywords["key"][1][0].module is _Stand
    assert type(factory.keywords["key"][1]) is tuple
    assert out["kept"] is tree["kept"]  # nothing replaced below it
    assert leaf.module is DotProductAttention  # the input is not modified


def test_a_replaced_part_is_not_walked_into() -> None:
    moe = MoESubmodules(experts=ModuleSpec(module=DotProductAttention))
    seen = []

    def replace(part):
        seen.append(part)
        return dataclasses.replace(part, experts=None) if isinstance(part, MoESubmodules) else part

    out = map_spec(ModuleSpec(module=object, submodules=moe), replace)
    assert out.submodules.experts is None
    assert moe in seen and moe.experts not in seen


def test_spec_parts_lists_the_node_first_then_top_down() -> None:
    inner = ModuleSpec(module=DotProductAttention)
    outer = [inner]
    parts = spec_parts(outer)
    assert parts[0] is outer and parts[1] is inner and DotProductAttention in parts
    assert parts.index(inner) < parts.index(DotProductAttention)
