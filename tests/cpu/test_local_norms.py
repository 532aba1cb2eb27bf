"""Tier: Megatron on one process (its local specs and torch norms). SP-capable local norms: Megatron's own
norm, parameters marked for the TP gradient all-reduce, swapped into every place of a spec."""

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_ext.cpu.local_norms import SequenceParallelTorchNorm, with_sequence_parallel_norms


def _config(normalization: str, sequence_parallel: bool):
    """Megatron's own config class (TP=2 so that it accepts sequence parallelism)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, normalization=normalization,
        tensor_model_parallel_size=2, sequence_parallel=sequence_parallel,
    )  # fmt: skip


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize(("normalization", "cls"), [("LayerNorm", torch.nn.LayerNorm),
                                                     ("RMSNorm", torch.nn.RMSNorm)])  # fmt: skip
def test_megatrons_norm_with_parameters_marked_sequence_parallel(
    normalization, cls, sequence_parallel
):
    config = _config(normalization, sequence_parallel)
    if sequence_parallel:
        with pytest.raises(AssertionError, match="sequence parallel"):
            WrappedTorchNorm(config, 8)  # what this class exists for
    norm = SequenceParallelTorchNorm(config, 8, eps=1e-6)
    assert type(norm) is cls and norm.eps == 1e-6
    params = list(norm.parameters())
    # The mark follows the config: True only under sequence parallelism (the TP all-reduce).
    assert params and all(p.sequence_parallel is sequence_parallel for p in params)
    assert config.sequence_parallel is sequence_parallel  # the caller's config is untouched


def _count(node, target) -> int:
    import dataclasses
    import functools

    if node is target:
        return 1
    if isinstance(node, functools.partial):
        return sum(_count(v, target) for v in (*node.args, *node.keywords.values()))
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return sum(_count(getattr(node, f.name), target) for f in dataclasses.fields(node))
    if isinstance(node, (list, tuple)):
        return sum(_count(n, target) for n in node)
    return 0


def test_every_norm_of_megatrons_local_moe_spec_is_swapped():
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    before = _count(spec, WrappedTorchNorm)
    assert before >= 2  # input and pre-MLP norms at least
    swapped = with_sequence_parallel_norms(spec)
    assert _count(swapped, WrappedTorchNorm) == 0
    assert _count(swapped, SequenceParallelTorchNorm) == before
    assert _count(spec, WrappedTorchNorm) == before  # the original spec is not modified
