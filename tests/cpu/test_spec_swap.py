"""Tests for megatron_ext.cpu.spec_swap. Tier: in process (Megatron's real layer specs, no ranks)."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_ext.cpu.spec_swap import swap_module


class _Stand(DotProductAttention):
    """A stand-in class to swap in."""


def _classes(node, seen=None) -> set:
    """Every class a spec tree references."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    seen = set() if seen is None else seen
    if isinstance(node, type):
        seen.add(node)
    elif isinstance(node, ModuleSpec):
        _classes(node.module, seen), _classes(node.submodules, seen)
    elif isinstance(node, functools.partial):
        for v in (*node.args, *node.keywords.values()):
            _classes(v, seen)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _classes(getattr(node, f.name), seen)
    elif isinstance(node, (list, tuple)):
        for n in node:
            _classes(n, seen)
    return seen


def test_every_reference_is_swapped_and_the_rest_is_the_same_object() -> None:
    spec = get_gpt_layer_local_spec(num_experts=8)
    assert DotProductAttention in _classes(spec)  # the interesting case: it is in there
    swapped = swap_module(spec, DotProductAttention, _Stand)
    assert DotProductAttention not in _classes(swapped) and _Stand in _classes(swapped)
    assert DotProductAttention in _classes(spec)  # the original spec is not changed
    # The MLP's spec holds no attention: returned as the same object.
    assert swapped.submodules.mlp is spec.submodules.mlp
    # A class the spec does not hold: the whole spec comes back as it was.
    assert swap_module(spec, type("Absent", (), {}), _Stand) is spec
