"""One typed view of the Megatron arguments megatron_ext's checks and callbacks read.

Each field has one default, Megatron-Core 0.19.2's parser default (a test checks), so a namespace
that lacks a field (a test's hand-built one) reads the same everywhere. Example::

    view = MegatronView.from_args(argparse.Namespace(fp8="e4m3"))
    view.fp8, view.fp8_recipe, view.load   # ('e4m3', 'delayed', None): Megatron's defaults
"""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class MegatronView:
    """The Megatron flags megatron_ext reads (argparse dest = field name).

    A snapshot: build it with :meth:`from_args` where a callback or check starts and pass it down.
    """

    # Not cached: Megatron sets some fields on its arguments after parsing (``padded_vocab_size``
    # when it builds the tokenizer). A field that is not a flag says so in its docstring.

    # Parallelism
    world_size: int = 1
    """Not a flag: the launch's processes, set on the arguments by Megatron's ``parse_args`` from
    ``WORLD_SIZE`` (1 when unset)."""
    tensor_model_parallel_size: int = 1
    """``--tensor-model-parallel-size``: tensor-parallel ranks."""
    pipeline_model_parallel_size: int = 1
    """``--pipeline-model-parallel-size``: pipeline stages."""
    context_parallel_size: int = 1
    """``--context-parallel-size``: context-parallel ranks."""
    hybrid_context_parallel: bool = False
    """``--hybrid-context-parallel``: a CP size chosen per micro-batch (Megatron's hybrid CP)."""
    cp_comm_type: list = dataclasses.field(default_factory=lambda: ["p2p"])
    """``--cp-comm-type``: how TE's attention exchanges K/V over the CP group, per layer."""
    hierarchical_context_parallel_sizes: list | None = None
    """``--hierarchical-context-parallel-sizes``: the CP group split for ``a2a+p2p``."""
    expert_model_parallel_size: int = 1
    """``--expert-model-parallel-size``: expert-parallel ranks."""
    expert_tensor_parallel_size: int | None = None
    """``--expert-tensor-parallel-size``: the experts' tensor-parallel ranks (None: as
    ``--tensor-model-parallel-size``; ``validate_args`` fills it in)."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations split over the tensor-parallel ranks along the sequence."""
    use_distributed_optimizer: bool = False
    """``--use-distributed-optimizer``: optimizer state sharded over data-parallel ranks."""
    overlap_moe_expert_parallel_comm: bool = False
    """``--overlap-moe-expert-parallel-comm``: Megatron's combined 1F1B schedule."""
    # Batches and schedule
    seq_length: int | None = None
    """``--seq-length``: tokens per sample."""
    micro_batch_size: int | None = None
    """``--micro-batch-size``: samples per micro-batch."""
    eval_micro_batch_size: int | None = None
    """``--eval-micro-batch-size``: samples per evaluation micro-batch (None: the training one)."""
    calculate_per_token_loss: bool = False
    """``--calculate-per-token-loss``: the loss divided by the global batch's token count."""
    rampup_batch_size: Any = None
    """``--rampup-batch-size``: Megatron's deprecated batch-size ramp-up (start, increment, samples)."""
    train_iters: int | None = None
    """``--train-iters``: training iterations."""
    train_samples: int | None = None
    """``--train-samples``: training samples (instead of ``--train-iters``)."""
    skip_train: bool = False
    """``--skip-train``: evaluate without training."""
    perform_rl_step: bool = False
    """``--perform-rl-step``: Megatron's RL training step."""
    lr: float | None = None
    """``--lr``: the learning rate (Megatron 0.19.2 has no default)."""
    eval_interval: int | None = None
    """``--eval-interval``: iterations between evaluations (Megatron 0.19.2 has no default)."""
    eval_iters: int = 100
    """``--eval-iters``: iterations per evaluation."""
    # Data
    data_path: Any = None
    """``--data-path``: the blend (weights and prefixes) split by ``--split``."""
    train_data_path: Any = None
    """``--train-data-path``: the training blend, without ``--split``."""
    valid_data_path: Any = None
    """``--valid-data-path``: the validation blend, without ``--split``."""
    test_data_path: Any = None
    """``--test-data-path``: the test blend, without ``--split``."""
    per_split_data_args_path: str | None = None
    """``--per-split-data-args-path``: a JSON file of the train, valid and test blends."""
    split: str | None = None
    """``--split``: the train, validation and test weights of ``--data-path`` (None:
    ``validate_args`` sets Megatron's legacy ``969, 30, 1``)."""
    data_args_path: str | None = None
    """``--data-args-path``: a file listing the blend (prefixes and weights)."""
    mock_data: bool = False
    """``--mock-data``: Megatron's synthetic dataset instead of token files."""
    data_cache_path: str | None = None
    """``--data-cache-path``: where the dataset index caches are kept."""
    dataloader_inter_document_masking: bool = False
    """``--dataloader-inter-document-masking``: attention masked across document boundaries."""
    multiple_validation_sets: bool = False
    """``--multiple-validation-sets``: one validation set per blend prefix."""
    full_validation: bool = False
    """``--full-validation``: evaluate on the whole validation split."""
    num_dataset_builder_threads: int = 1
    """``--num-dataset-builder-threads``: threads of Megatron's dataset builder."""
    mid_level_dataset_surplus: float = 0.005
    """``--mid-level-dataset-surplus``: extra samples a blended dataset asks of its parts."""
    object_storage_cache_path: str | None = None
    """``--object-storage-cache-path``: local cache of object-storage datasets."""
    sft: bool = False
    """``--sft``: Megatron's SFTDataset."""
    sft_tokenizer_prompt_format: str = "nemotron-h-aligned"
    """``--sft-tokenizer-prompt-format``: the chat template of ``SFTTokenizer``."""
    fim_data: bool = False
    """``--fim-data``: Megatron's GPTFIMDataset."""
    dataloader_fast_cache_load: bool = False
    """``--dataloader-fast-cache-load``: dataset index caches loaded without their checks."""
    dataloader_defer_npy_index_mmap: bool = False
    """``--dataloader-defer-npy-index-mmap``: dataset indices memory-mapped on first use."""
    per_dataset_sequences_path: str | None = None
    """``--per-dataset-sequences-path``: each dataset's sequence counts, precomputed."""
    # Tokenizer
    tokenizer_type: str | None = None
    """``--tokenizer-type``: Megatron's tokenizer class (``NullTokenizer``, ...)."""
    tokenizer_model: str | None = None
    """``--tokenizer-model``: the tokenizer's file or directory."""
    vocab_size: int | None = None
    """``--vocab-size``: the vocabulary of ``NullTokenizer``."""
    padded_vocab_size: int | None = None
    """Not a flag: the embedding rows, set on the arguments when Megatron builds its tokenizer."""
    # Checkpoints
    load: str | None = None
    """``--load``: the directory a run resumes from."""
    save: str | None = None
    """``--save``: the directory a run saves to."""
    ckpt_format: str = "torch_dist"
    """``--ckpt-format``: the checkpoints' format (``torch_dist``, ``torch``, ...)."""
    pretrained_checkpoint: str | None = None
    """``--pretrained-checkpoint``: weights to fine-tune from when ``--load`` holds none."""
    ckpt_step: int | None = None
    """``--ckpt-step``: the iteration to load instead of the tracker's."""
    non_persistent_ckpt_type: str | None = None
    """``--non-persistent-ckpt-type``: non-persistent checkpoints (left to Megatron)."""
    exit_on_missing_checkpoint: bool = False
    """``--exit-on-missing-checkpoint``: stop when ``--load`` holds no checkpoint."""
    async_save: bool = False
    """``--async-save``: checkpoints saved in the background."""
    finetune: bool = False
    """``--finetune``: load the weights only (no optimizer, iteration 0)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """``--use-checkpoint-opt-param-scheduler``: a resume keeps the checkpoint's LR schedule."""
    use_mup: bool = False
    """``--use-mup``: MuP's per-group learning rates."""
    no_load_optim: bool | None = None
    """``--no-load-optim``: do not load the optimizer state (Megatron's default is None)."""
    ckpt_fully_parallel_load: bool = False
    """``--ckpt-fully-parallel-load``: checkpoint shards loaded by every data-parallel rank."""
    # Model
    num_layers: int | None = None
    """``--num-layers``: decoder layers."""
    hidden_size: int | None = None
    """``--hidden-size``: the model's width."""
    transformer_impl: str = "transformer_engine"
    """``--transformer-impl``: ``transformer_engine`` or ``local`` modules."""
    multi_latent_attention: bool = False
    """``--multi-latent-attention``: MLA instead of multi-head attention."""
    mtp_num_layers: int | None = None
    """``--mtp-num-layers``: multi-token-prediction layers."""
    num_experts: int | None = None
    """``--num-experts``: experts per MoE layer (None: a dense model)."""
    moe_layer_freq: Any = 1
    """``--moe-layer-freq``: every N-th layer an MoE layer, or a 0/1 list per layer."""
    hybrid_layer_pattern: str | None = None
    """``--hybrid-layer-pattern``: a HybridModel's layer symbols."""
    hybrid_override_pattern: str | None = None
    """``--hybrid-override-pattern``: the deprecated name of ``--hybrid-layer-pattern`` (Megatron's
    ``validate_args`` copies it over)."""
    heterogeneous_layers_config_path: str | None = None
    """``--heterogeneous-layers-config-path``: a GPT model's per-layer configuration file."""
    yaml_cfg: str | None = None
    """``--yaml-cfg``: the model's configuration from a YAML file instead of flags."""
    # MoE
    moe_router_topk: int = 2
    """``--moe-router-topk``: experts each token is routed to."""
    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``: the experts as one grouped GEMM."""
    moe_token_dispatcher_type: str = "allgather"
    """``--moe-token-dispatcher-type``: ``allgather``, ``alltoall`` or ``flex``."""
    moe_router_padding_for_quantization: bool = False
    """``--moe-router-padding-for-quantization``: Megatron's own fp8/fp4 group padding (in the
    routing map)."""
    moe_pad_expert_input_to_capacity: bool = False
    """``--moe-pad-expert-input-to-capacity``: every expert's group padded to its capacity."""
    moe_expert_capacity_factor: float | None = None
    """``--moe-expert-capacity-factor``: tokens over an expert's capacity dropped (None: dropless)."""
    moe_router_enable_expert_bias: bool = False
    """``--moe-router-enable-expert-bias``: aux-loss-free balancing by a per-expert bias."""
    moe_permute_fusion: bool = False
    """``--moe-permute-fusion``: Transformer Engine's fused permute."""
    # Loss guards
    check_for_nan_in_loss_and_grad: bool = True
    """``--no-check-for-nan-in-loss-and-grad``: NaN / Inf in a local loss or gradient is fatal."""
    check_for_spiky_loss: bool = False
    """``--check-for-spiky-loss``: a local loss 10x the largest seen is reported."""
    # Precision
    fp8: str | None = None
    """``--fp8-format``: fp8 GEMMs (``e4m3``, ``hybrid``; None: off)."""
    fp8_recipe: str = "delayed"
    """``--fp8-recipe``: the fp8 scaling recipe (read only with ``--fp8-format``)."""
    fp4: str | None = None
    """``--fp4-format``: fp4 GEMMs (``e2m1``; None: off)."""
    fp4_recipe: str = "nvfp4"
    """``--fp4-recipe``: the fp4 scaling recipe (read only with ``--fp4-format``)."""
    bf16: bool = False
    """``--bf16``: bf16 parameters and compute."""
    fp16: bool = False
    """``--fp16``: fp16 parameters and compute."""
    fp8_param_gather: bool = False
    """``--fp8-param-gather``: parameters kept and gathered in fp8."""
    fp4_param_gather: bool = False
    """``--fp4-param-gather``: parameters kept and gathered in fp4."""
    # GPU-only machinery (a --cpu launch refuses it)
    distributed_backend: str = "nccl"
    """``--distributed-backend``: ``nccl`` or ``gloo``."""
    tp_comm_overlap: bool = False
    """``--tp-comm-overlap``: Transformer Engine's userbuffers overlap of tensor-parallel comms."""
    te_rng_tracker: bool = False
    """``--te-rng-tracker``: Transformer Engine's RNG tracker."""
    use_transformer_engine_op_fuser: bool = False
    """``--use-transformer-engine-op-fuser``: Transformer Engine's fused ops (its grouped GEMM
    needs groups of 256 rows under fp8/fp4)."""
    enable_cuda_graph: bool = False
    """``--enable-cuda-graph``: Megatron's CUDA graphs (deprecated form)."""
    external_cuda_graph: bool = False
    """``--external-cuda-graph``: CUDA graphs captured outside the layers (deprecated form)."""
    cuda_graph_impl: str = "none"
    """``--cuda-graph-impl``: which CUDA graphs capture the model (``none``: no graphs)."""
    cuda_graph_modules: list = dataclasses.field(default_factory=list)
    """``--cuda-graph-modules``: the modules a CUDA graph captures (empty: the whole layer)."""
    position_embedding_type: str = "learned_absolute"
    """``--position-embedding-type``: ``learned_absolute``, ``rope``, ``yarn``, ``mrope``, ``none``."""
    softmax_type: str = "vanilla"
    """``--softmax-type``: the attention softmax (``vanilla``, ``off-by-one``, ``learnable``)."""
    window_size: Any = None
    """``--window-size``: sliding-window attention (None: full causal attention)."""
    use_torch_fsdp2: bool = False
    """``--use-torch-fsdp2``: PyTorch's FSDP2."""
    use_megatron_fsdp: bool = False
    """``--use-megatron-fsdp``: Megatron's FSDP."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MegatronView":
        """The view of Megatron's parsed ``args`` (or of a ``TransformerConfig``, whose fields
        share the names); an attribute they lack reads as the default."""
        return cls(**_read(cls, args))


@dataclass(frozen=True, kw_only=True)
class TrainingProgress:
    """What Megatron's training sets on its arguments as it runs (none is a flag; None reads as 0)."""

    # Apart from MegatronView because Megatron's loop advances these: read per call, never kept.

    iteration: int = 0
    """The iteration Megatron's checkpoint load resumed from."""
    curr_iteration: int = 0
    """The iteration Megatron's training loop is running."""
    consumed_train_samples: int = 0
    """Training samples consumed so far (a resume's are restored from the checkpoint)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainingProgress":
        """The progress recorded on Megatron's ``args`` now."""
        # Each is set only once Megatron's load or loop reaches it: until then, absent or None is 0.
        return cls(**{name: value or 0 for name, value in _read(cls, args).items()})


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (a fresh one for a ``default_factory`` field)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _read(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    # The one read of Megatron's namespace field by field: an absent attribute is the default.
    return {f.name: getattr(args, f.name, field_default(f)) for f in dataclasses.fields(cls)}
