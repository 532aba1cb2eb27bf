"""A tiny MoE ``GPTModel`` built from Megatron's real classes (local layer spec), sized for CPU tests.

Call inside :func:`megatron_ext.testing.run_distributed` (Megatron's parallel state must be initialised); the
expert-parallel size is read from it.

Example::

    config = tiny_moe_config(moe_token_dispatcher_type="allgather")
    model = build_tiny_gpt(config)                  # 2 layers, 8 experts, top-2, rope
    logits = model(tokens, position_ids, attention_mask=None)
"""

import copy
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext.testing.distributed import sequence_parallel


def tiny_moe_config(**overrides: Any) -> TransformerConfig:
    """A fp32, dropout-free, dropless 8-expert top-2 MoE config; ``overrides`` win.

    ``num_moe_experts=None`` in ``overrides`` gives a dense model.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        sequence_parallel=sequence_parallel() and tp > 1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=False,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        add_bias_linear=False,
    )
    fields.update(overrides)
    if fields["num_moe_experts"] is None:
        for key in [k for k in fields if k.startswith("moe_")]:
            fields.pop(key)
    return TransformerConfig(**fields)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with Megatron's norm signature that accepts sequence parallelism.

    Megatron's local torch-norm wrapper asserts ``not config.sequence_parallel`` (TE's norms are the SP
    path on GPU); a LayerNorm is per token, so it is exact on a sequence shard. Its parameters are marked
    ``sequence_parallel`` so their gradients are all-reduced over TP as Megatron does for TE norms.
    """

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any
    ):
        del kwargs
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def local_layer_spec(config: TransformerConfig) -> Any:
    """Megatron's local GPT spec for ``config``; with sequence parallelism a block spec whose norms
    are :class:`SequenceParallelLayerNorm`."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if not config.sequence_parallel:
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * config.num_layers, layer_norm=SequenceParallelLayerNorm
    )


def build_tiny_gpt(
    config: TransformerConfig,
    *,
    vocab_size: int = 128,
    max_seq_len: int = 64,
    layer_spec: ModuleSpec | None = None,
    position_embedding_type: str = "rope",
) -> GPTModel:
    """Builds Megatron's ``GPTModel`` on CPU with :func:`local_layer_spec` unless a spec is given."""
    if layer_spec is None:
        layer_spec = local_layer_spec(config)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        position_embedding_type=position_embedding_type,
    )
