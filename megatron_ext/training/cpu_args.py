"""Argument-time checks of ``--cpu``: what Megatron's loop cannot run on CPU is refused, naming the flag.

``--cpu`` runs the same ``megatron.training.pretrain`` over gloo with local modules. Transformer Engine
modules, CUDA graphs and NCCL need a GPU, so they are refused before anything starts rather than failing
in the middle of model construction.
"""

import argparse

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import flag_value
from megatron_ext.training import feature_configs  # noqa: F401  (registers the flags read here)

#: Megatron flags (dest, value that needs a GPU, flag, what to use instead).
_GPU_ONLY: tuple[tuple[str, object, str, str], ...] = (
    ("transformer_impl", "transformer_engine", "--transformer-impl transformer_engine",
     "use --transformer-impl local"),
    ("distributed_backend", "nccl", "--distributed-backend nccl",
     "--cpu implies --distributed-backend gloo"),
    ("tp_comm_overlap", True, "--tp-comm-overlap", "drop it (Transformer Engine userbuffers)"),
    ("te_rng_tracker", True, "--te-rng-tracker", "drop it (Transformer Engine)"),
    ("use_transformer_engine_op_fuser", True, "--use-transformer-engine-op-fuser", "drop it"),
    ("enable_cuda_graph", True, "--enable-cuda-graph", "drop it (CUDA graphs)"),
    ("external_cuda_graph", True, "--external-cuda-graph", "drop it (CUDA graphs)"),
    ("use_torch_fsdp2", True, "--use-torch-fsdp2", "drop it"),
    ("use_megatron_fsdp", True, "--use-megatron-fsdp", "drop it"),
    ("ckpt_fully_parallel_load", True, "--ckpt-fully-parallel-load",
     "drop it (Megatron moves loaded shards with .cuda())"),
    ("async_save", True, "--async-save", "drop it (needs nvidia-resiliency-ext and CUDA)"),
    ("fp8_param_gather", True, "--fp8-param-gather",
     "drop it (a --cpu rehearsal builds an unquantized model)"),
    ("fp4_param_gather", True, "--fp4-param-gather",
     "drop it (a --cpu rehearsal builds an unquantized model)"),
    ("moe_token_dispatcher_type", "flex", "--moe-token-dispatcher-type flex",
     "use alltoall or allgather (flex needs DeepEP or HybridEP)"),
    ("moe_permute_fusion", True, "--moe-permute-fusion",
     "drop it (Transformer Engine's fused permute)"),
    ("multi_latent_attention", True, "--multi-latent-attention",
     "drop it (Megatron's local attention has no MLA path: its DotProductAttention takes no "
     "k_channels; MLA needs Transformer Engine)"),
)  # fmt: skip


def check_cpu_args(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the first flag ``--cpu`` cannot run with."""
    view = MegatronView.from_args(args)
    for dest, gpu_value, flag, instead in _GPU_ONLY:
        if getattr(view, dest) == gpu_value:
            raise ValueError(f"--cpu cannot run {flag}: {instead}")
    if view.fp8 or view.fp4:
        flag = "--fp8-format" if view.fp8 else "--fp4-format"
        for is_set, needed in (
            (flag_value(args, "moe_dispatch_align"), "--moe-dispatch-align"),
            (view.moe_grouped_gemm, "--moe-grouped-gemm"),
        ):
            if not is_set:
                raise ValueError(
                    f"--cpu with {flag} rehearses the quantized run's expert-group alignment on "
                    f"grouped-GEMM experts: it needs {needed} (the model itself computes "
                    "unquantized on CPU)"
                )
    for is_set, flag in ((view.bf16, "--bf16"), (view.fp16, "--fp16")):
        if is_set:
            raise ValueError(
                f"--cpu cannot run {flag} yet: Megatron's Float16OptimizerWithFloat16Params accepts "
                "only torch.cuda parameter types; drop it (the CPU run computes in fp32)"
            )
    if view.use_distributed_optimizer:
        raise ValueError(
            "--cpu cannot run --use-distributed-optimizer: Megatron's distributed optimizer "
            "accepts only torch.cuda parameter types; drop it"
        )
    tp = view.tensor_model_parallel_size or 1
    etp = view.expert_tensor_parallel_size or tp
    if view.moe_grouped_gemm and view.num_experts and etp > 1:
        raise ValueError(
            f"--cpu with --moe-grouped-gemm needs --expert-tensor-parallel-size 1 (got {etp}; it "
            "defaults to --tensor-model-parallel-size): megatron_ext's CPU grouped-GEMM experts "
            "do not shard the experts over tensor-parallel ranks"
        )
    if view.mtp_num_layers:
        raise ValueError(
            "--cpu cannot run --mtp-num-layers: Megatron's MTP loss logging calls torch.cuda"
        )
    if (view.context_parallel_size or 1) > 1:
        # --sft samples are packs too (SelfPaddedSFTDataset: cu_seqlens, THD under CP).
        _check_cpu_context_parallel(view, bool(flag_value(args, "pack_documents") or view.sft))
    impl = view.cuda_graph_impl or "none"
    if impl != "none":
        raise ValueError(f"--cpu cannot run --cuda-graph-impl {impl} (CUDA graphs): drop it")


def _check_cpu_context_parallel(view: MegatronView, packed: bool) -> None:
    """What the ``--cpu`` context-parallel attention (megatron_ext/cpu/cp_attention.py) does not
    model, refused naming the flag: it attends over the K/V of the whole CP group, causally."""
    rope = view.position_embedding_type in ("rope", "yarn", "mrope")
    if rope and not packed:
        raise ValueError(
            f"--cpu with --context-parallel-size > 1 and --position-embedding-type "
            f"{view.position_embedding_type} needs --pack-documents (or --sft): Megatron's per-sequence CP "
            "path slices the rotary table with a CUDA index (get_pos_emb_on_this_cp_rank)"
        )
    kinds = set(view.cp_comm_type or ["p2p"])
    refused = (
        (view.hybrid_context_parallel, "--hybrid-context-parallel",
         "a CP size chosen per micro-batch"),
        (kinds != {"p2p"}, f"--cp-comm-type {' '.join(view.cp_comm_type)}",
         "exchanges other than Megatron's default p2p (it gathers K/V over the CP group)"),
        (view.hierarchical_context_parallel_sizes, "--hierarchical-context-parallel-sizes",
         "hierarchical (a2a+p2p) CP groups"),
        (view.softmax_type != "vanilla", f"--softmax-type {view.softmax_type}",
         "softmax variants other than vanilla"),
        (view.window_size is not None, "--window-size", "sliding-window attention"),
    )  # fmt: skip
    for is_set, flag, why in refused:
        if is_set:
            raise ValueError(
                f"--cpu with --context-parallel-size > 1 cannot run {flag}: the CPU "
                f"context-parallel attention does not model {why}"
            )
