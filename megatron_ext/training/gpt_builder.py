"""GPT's model config and builder where Megatron has none: megatron-core 0.18.2.

megatron-core 0.19.2 builds a GPT model from ``megatron.training.models.gpt``; 0.18.2 ships only the
hybrid ones (its GPT model was built by Megatron-LM's own ``gpt_builders.py``). These have the same
interface, so the model provider is one code path. Example::

    config_from_args, default_spec, Config, Builder = gpt_classes()
    model = Builder(config_from_args(args)).build_model(pg_collection, True, True)
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ext.config.megatron_view import MegatronView


def has_megatron_gpt_builder() -> bool:
    """Whether Megatron ships ``megatron.training.models.gpt`` (0.19 on; not 0.18.2)."""
    import importlib.util

    return importlib.util.find_spec("megatron.training.models.gpt") is not None


def gpt_classes() -> tuple[Callable[..., Any], Callable[..., Any], type, type]:
    """``(gpt_config_from_args, default_layer_spec, GPTModelConfig, GPTModelBuilder)``:
    Megatron's where it has them, else this module's."""
    # One interface: config.transformer, config.transformer_layer_spec and
    # Builder(config).build_model(pg_collection, pre_process, post_process, vp_stage).
    if not has_megatron_gpt_builder():
        return gpt_config_from_args, default_layer_spec, GPTConfig, GPTBuilder
    from megatron.training import argument_utils
    from megatron.training.models import gpt

    return (argument_utils.gpt_config_from_args, gpt.default_layer_spec, gpt.GPTModelConfig,
            gpt.GPTModelBuilder)  # fmt: skip


def check_gpt_builder(view: MegatronView) -> None:
    """Refuses, where Megatron has no GPT builder (0.18.2), a GPT model this module does not build
    as Megatron would: a heterogeneous layer file, or the model read from a YAML file (0.19.2's
    builder reads both; 0.18.2 has no ``--experimental-attention-variant`` at all)."""
    if view.hybrid_layer_pattern is not None or has_megatron_gpt_builder():
        return
    flags = {"--heterogeneous-layers-config-path": view.heterogeneous_layers_config_path,
             "--yaml-cfg": view.yaml_cfg}  # fmt: skip
    for flag, value in flags.items():
        if value is not None:
            raise ValueError(
                f"{flag} needs megatron-core 0.19.2 for a GPT model: 0.18.2 has no GPT model "
                "builder, and megatron_ext's (megatron_ext/training/gpt_builder.py) builds only "
                "the layer specs of the flags"
            )


@dataclass(kw_only=True)
class GPTConfig:
    """What ``GPTModel`` is built from (the fields of 0.19.2's ``GPTModelConfig`` megatron_ext's
    launches set)."""

    transformer: Any
    transformer_layer_spec: Any = None
    vocab_size: int
    seq_length: int
    fp16_lm_cross_entropy: bool = False
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    seq_len_interpolation_factor: float | None = None


def gpt_config_from_args(args: argparse.Namespace, config: Any = None) -> GPTConfig:
    """:class:`GPTConfig` of Megatron's parsed ``args`` (``config``: the transformer config, else
    Megatron's ``core_transformer_config_from_args``), read as 0.19.2's ``gpt_config_from_args``
    reads them (``--padded-vocab-size`` is set by then: Megatron pads it from the tokenizer)."""
    from megatron.training.arguments import core_transformer_config_from_args

    spec = None
    if args.spec is not None:
        from megatron.core.transformer.spec_utils import import_module

        spec = import_module(args.spec)
    return GPTConfig(
        transformer=config if config is not None else core_transformer_config_from_args(args),
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        seq_length=args.max_position_embeddings,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )


def _layer_spec(transformer: Any, use_te: bool) -> Any:
    """One transformer layer's spec, Transformer Engine's or the local modules'."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    shared = dict(
        num_experts=transformer.num_moe_experts,
        moe_grouped_gemm=transformer.moe_grouped_gemm,
        qk_layernorm=transformer.qk_layernorm,
        multi_latent_attention=transformer.multi_latent_attention,
        qk_l2_norm=transformer.qk_l2_norm,
    )
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**shared)
    return specs.get_gpt_layer_local_spec(**shared, normalization=transformer.normalization)


def default_layer_spec(config: GPTConfig, vp_stage: int | None = None) -> Any:
    """Megatron's spec for the run: an MoE model's decoder block spec (per-layer MoE or dense,
    this stage's layers), else one layer's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    transformer = config.transformer
    use_te = transformer.transformer_impl == "transformer_engine"
    if transformer.num_moe_experts is not None:
        return get_gpt_decoder_block_spec(
            transformer, use_transformer_engine=use_te, normalization=transformer.normalization,
            qk_l2_norm=transformer.qk_l2_norm, vp_stage=vp_stage,
        )  # fmt: skip
    return _layer_spec(transformer, use_te)


def _mtp_spec(config: GPTConfig, layer_spec: Any, vp_stage: int | None) -> Any:
    """The MTP block's spec (None without ``--mtp-num-layers``): the decoder's last layer's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    transformer = config.transformer
    if transformer.mtp_num_layers is None:
        return None
    use_te = transformer.transformer_impl == "transformer_engine"
    if getattr(layer_spec, "layer_specs", None) == []:  # a last stage without decoder layers
        layer_spec = _layer_spec(transformer, use_te)
    return get_gpt_mtp_block_spec(
        transformer, layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage
    )


class GPTBuilder:
    """Builds one ``GPTModel`` stage from a :class:`GPTConfig` (0.19.2's ``GPTModelBuilder``'s
    ``build_model``)."""

    def __init__(self, config: GPTConfig) -> None:
        self.config = config

    def build_model(
        self,
        pg_collection: Any,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
    ) -> Any:
        import logging

        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.utils import log_single_rank

        # What Megatron-LM 0.18's own GPT builder printed; the real-loop tests read it.
        log_single_rank(logging.getLogger(__name__), logging.INFO, "building GPTModel ...")
        cfg = self.config
        spec = cfg.transformer_layer_spec
        if spec is None:
            spec = default_layer_spec(cfg, vp_stage)
        elif callable(spec) and not hasattr(spec, "module"):  # a function of (config, vp_stage)
            spec = spec(cfg, vp_stage=vp_stage)
        return GPTModel(
            config=cfg.transformer, transformer_layer_spec=spec,
            mtp_block_spec=_mtp_spec(cfg, spec, vp_stage), vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length, fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
            rotary_percent=cfg.rotary_percent, rotary_base=cfg.rotary_base,
            rope_scaling=cfg.rope_scaling,
            seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
            pre_process=pre_process, post_process=post_process, pg_collection=pg_collection,
            vp_stage=vp_stage,
        )  # fmt: skip
