"""Megatron 0.19.2 settings under which route replay would be silently skipped or undone.

Megatron's ``RouterReplay`` hooks only the unfused top-k inside
``moe_utils.topk_routing_with_score_function``: every path that routes around that hook, or edits
the routing map after it, would train on other routes without an error. They are refused when
arguments are parsed and again when the binding sees the model's ``TransformerConfig`` (this
module reads attributes only: Megatron's argument names equal its config field names)::

    replay_blockers(argparse.Namespace(num_experts=8, moe_router_fusion=True))
    # -> ['--moe-router-fusion (the fused TE top-k returns before RouterReplay is consulted)']
"""

from typing import Any


def load_balancing_types(settings: Any) -> list[str]:
    """``--moe-router-load-balancing-type`` as a list (Megatron takes one type or several)."""
    value = getattr(settings, "moe_router_load_balancing_type", "aux_loss") or "aux_loss"
    return [value] if isinstance(value, str) else list(value)


def replay_blockers(settings: Any) -> list[str]:
    """One line per setting of ``settings`` (Megatron's ``args`` or a ``TransformerConfig``) that
    would bypass or undo route replay; empty: supported."""
    blockers = []
    if getattr(settings, "moe_router_fusion", False):
        blockers.append(
            "--moe-router-fusion (the fused TE top-k returns before RouterReplay is consulted)"
        )
    # sinkhorn never calls the hook; quantile_balancing precomputes the top-k past it.
    for kind in ("sinkhorn", "quantile_balancing"):
        if kind in load_balancing_types(settings):
            blockers.append(
                f"--moe-router-load-balancing-type {kind} (its routing bypasses RouterReplay)"
            )
    if getattr(settings, "moe_expert_capacity_factor", None) is not None:
        blockers.append(
            "--moe-expert-capacity-factor (token dropping rewrites replayed routes afterwards)"
        )
    cuda_graph_impl = getattr(settings, "cuda_graph_impl", "none") or "none"
    if cuda_graph_impl != "none":
        blockers.append(
            f"--cuda-graph-impl {cuda_graph_impl} (a captured router replays captured indices)"
        )
    # Its per-rank token layout is not the zigzag the binding slices routes by.
    if getattr(settings, "hybrid_context_parallel", False):
        blockers.append("--hybrid-context-parallel (routes are laid out for zigzag CP only)")
    # Megatron's args call it num_experts, its TransformerConfig num_moe_experts.
    if not (getattr(settings, "num_moe_experts", None) or getattr(settings, "num_experts", None)):
        blockers.append("no --num-experts (a dense model has no routers to replay)")
    return blockers


def check_replay_supported(settings: Any, mode_flag: str) -> None:
    """Raises ``ValueError`` naming ``mode_flag`` (how replay was turned on, e.g.
    ``"--route-replay-mode replay"``) and every blocking Megatron flag."""
    blockers = replay_blockers(settings)
    if blockers:
        raise ValueError(
            f"{mode_flag} is not supported with: "
            + "; ".join(blockers)
            + ". Megatron 0.19.2 would silently route natively there."
        )


def check_virtual_pipeline(settings: Any) -> None:
    """Refuses route replay or record under virtual pipeline stages on a ``HybridModel``."""
    # A GPTModel binds each model chunk (tested in Megatron's loop against the plain pipeline);
    # a HybridModel's is untested.
    vpp = getattr(settings, "virtual_pipeline_model_parallel_size", None) or 1
    mode = getattr(settings, "route_replay_mode", "off")
    if vpp > 1 and mode != "off" and getattr(settings, "hybrid_layer_pattern", None) is not None:
        raise ValueError(
            f"--route-replay-mode {mode} with --virtual-pipeline-model-parallel-size / "
            "--num-layers-per-virtual-pipeline-stage is supported for a GPTModel only, not a "
            "HybridModel (--hybrid-layer-pattern)"
        )
