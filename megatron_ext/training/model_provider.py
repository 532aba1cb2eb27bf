"""Model provider for ``megatron_ext.pretrain_gpt``: Megatron's own model builders plus our MoE layer spec.

The model class, config and builder are Megatron's (``GPTModel`` or, with ``--hybrid-layer-pattern``,
``HybridModel``); the only change is the layer spec, where the run asks for megatron_ext's MoE layer
or router. Example (inside an initialised Megatron run)::

    model = model_provider(pre_process=True, post_process=True)
"""

import argparse
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.training import run_state
from megatron_ext.training.feature_configs import EntryConfig, MoEAlignmentConfig, ReplayConfig


def uses_aligned_moe(alignment: MoEAlignmentConfig, skip_pads: bool = False) -> bool:
    """Whether the MoE layers must be megatron_ext's (alignment, load metrics or pad skipping:
    ``--moe-pad-routing skip``, or ``auto`` for a dropless run)."""
    return alignment.moe_dispatch_align or alignment.moe_expert_load_metrics or skip_pads


def _aligned(spec: Any, args: argparse.Namespace) -> Any:
    """``spec`` with megatron_ext's MoE layer and router where the run asks for them."""
    from megatron_ext.moe.layer_specs import has_moe_layer, with_aligned_moe, with_padded_router

    if args.num_experts is None or not has_moe_layer(spec):
        # A dense model, or a pipeline stage holding only dense layers (--moe-layer-freq).
        return _with_sp_norms(spec, args)

    alignment = run_state.configs(args)[MoEAlignmentConfig]
    pad_routing = run_state.pad_routing(args)
    if uses_aligned_moe(alignment, pad_routing.skip):
        metrics = run_state.load_metrics(args)
        spec = with_aligned_moe(
            spec, alignment, metrics, padded_router=False, pad_routing=pad_routing
        )
    if run_state.configs(args)[EntryConfig].cpu and args.moe_grouped_gemm:
        from megatron_ext.moe.layer_specs import with_grouped_mm_experts

        # --cpu: the torch._grouped_mm backend stands in for Transformer Engine's grouped GEMM.
        spec = with_grouped_mm_experts(spec)
    spec = _with_sp_norms(spec, args)
    # Megatron's own router unless expert bias needs ours (0.19.2's count fails on the pad mask) or
    # a capacity factor does (ours drops pads before real tokens).
    if args.moe_router_enable_expert_bias:
        spec = with_padded_router(spec, require="--moe-router-enable-expert-bias")
    elif args.moe_expert_capacity_factor is not None:
        spec = with_padded_router(spec, require="--moe-expert-capacity-factor")
    return spec


def _with_sp_norms(spec: Any, args: argparse.Namespace) -> Any:
    """The local modules Megatron refuses a parallelism for, where the run uses it: SP norms, and
    under ``--cpu`` the context-parallel attention rehearsal (Megatron's local attention refuses
    CP; TE's is its CP path)."""
    if args.sequence_parallel and args.transformer_impl == "local":
        from megatron_ext.cpu.local_norms import with_sequence_parallel_norms

        # Megatron's local norms refuse SP (TE's are its SP path); ours mark params for TP reduce.
        spec = with_sequence_parallel_norms(spec)
    if args.context_parallel_size > 1 and run_state.configs(args)[EntryConfig].cpu:
        from megatron_ext.cpu.cp_attention import with_context_parallel_attention

        spec = with_context_parallel_attention(spec)
    return spec


def model_config_from_args(args: argparse.Namespace, config: Any = None) -> Any:
    """Megatron's GPT/Hybrid model config for ``args``, with megatron_ext's layer spec."""
    from megatron.training.argument_utils import hybrid_config_from_args
    from megatron.training.utils import is_hybrid_model

    from megatron_ext.training.gpt_builder import gpt_classes

    # As Megatron 0.19's entry points choose: --hybrid-layer-pattern set means HybridModel.
    if is_hybrid_model(args):
        model_cfg = hybrid_config_from_args(args, config)
        if model_cfg.hybrid_stack_spec is None:
            model_cfg.hybrid_stack_spec = _default_hybrid_stack_spec(model_cfg)
        model_cfg.hybrid_stack_spec = _aligned(model_cfg.hybrid_stack_spec, args)
        return model_cfg
    gpt_config_from_args, default_layer_spec, _, _ = gpt_classes()  # 0.18.2: megatron_ext's
    model_cfg = gpt_config_from_args(args, config)
    user_spec = model_cfg.transformer_layer_spec

    def layer_spec(cfg: Any, vp_stage: int | None = None) -> ModuleSpec:
        spec = user_spec if user_spec is not None else default_layer_spec(cfg, vp_stage)
        return _aligned(spec, args)

    model_cfg.transformer_layer_spec = layer_spec
    return model_cfg


def _default_hybrid_stack_spec(model_cfg: Any) -> Any:
    """Megatron's TE hybrid stack spec, or megatron_ext's local-module one (CPU, no TE)."""
    if model_cfg.transformer.transformer_impl == "transformer_engine":
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        return hybrid_stack_spec
    from megatron_ext.moe.layer_specs import get_local_hybrid_stack_spec

    return get_local_hybrid_stack_spec(
        num_experts=model_cfg.transformer.num_moe_experts, padded_router=False
    )


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
) -> Any:
    """Builds this rank's model stage (Megatron's ``model_provider`` signature)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import get_args

    args = get_args()
    model_cfg = model_config_from_args(args, config)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    builder_cls = _builder_class(model_cfg)
    model = builder_cls(model_cfg).build_model(
        pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
    )
    rehearsal = run_state.state(args).rehearsal
    if rehearsal is not None:
        from megatron_ext.training.cpu_rehearsal import GroupLog, rehearse_quantized_moe

        run = run_state.state(args)
        run.rehearsal_log = run.rehearsal_log or GroupLog()
        rehearse_quantized_moe(model, rehearsal, run.rehearsal_log)
    # Bound right here, so every MoE router on this stage replays (or records) routes keyed per
    # micro-batch.
    replay = run_state.configs(args)[ReplayConfig]
    if replay.route_replay_mode != "off":
        run_state.bind_replay(model, replay)
    return model


def _builder_class(model_cfg: Any) -> type:
    from megatron.training.models import HybridModelBuilder

    from megatron_ext.training.gpt_builder import gpt_classes

    _, _, config_class, builder_class = gpt_classes()
    return builder_class if isinstance(model_cfg, config_class) else HybridModelBuilder
