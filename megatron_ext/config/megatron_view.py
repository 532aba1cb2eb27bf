"""One typed view of the Megatron arguments megatron_ext reads below its entry point.

Megatron hands its callbacks (datasets provider, forward step) its parsed ``argparse.Namespace``;
megatron_ext's own flags become feature configs (``megatron_ext/training/feature_configs.py``), and the Megatron flags
the code below the entry reads come through :class:`MegatronView`: one frozen dataclass, each field
with one default (Megatron-Core 0.19.2's parser default, which a test checks) and a docstring naming
the flag. A namespace that lacks a field (a test's hand-built one) reads as that default, the same
everywhere.

The view is a snapshot, not cached: Megatron sets some of these on its arguments after parsing
(``padded_vocab_size`` when it builds the tokenizer), so each reader builds it where it starts
(``MegatronView.from_args(args)`` at the top of a callback or check) and passes it down. What
Megatron's training loop advances (the iteration, the consumed samples) is
:class:`TrainingProgress`, read per call in the same way.

Example::

    view = MegatronView.from_args(argparse.Namespace(fp8="e4m3"))
    view.fp8, view.fp8_recipe, view.load   # ('e4m3', 'delayed', None): Megatron's defaults
"""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class MegatronView:
    """The Megatron flags megatron_ext reads below its entry point (argparse dest = field name)."""

    # Data
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
    no_load_optim: bool | None = None
    """``--no-load-optim``: do not load the optimizer state (Megatron's default is None)."""
    # Model
    num_layers: int | None = None
    """``--num-layers``: decoder layers."""
    num_experts: int | None = None
    """``--num-experts``: experts per MoE layer (None: a dense model)."""
    moe_layer_freq: Any = 1
    """``--moe-layer-freq``: every N-th layer an MoE layer, or a 0/1 list per layer."""
    hybrid_layer_pattern: str | None = None
    """``--hybrid-layer-pattern``: a HybridModel's layer symbols."""
    hybrid_override_pattern: str | None = None
    """``--hybrid-override-pattern``: the deprecated name of ``--hybrid-layer-pattern`` (Megatron's
    ``validate_args`` copies it over)."""
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MegatronView":
        """The view of Megatron's parsed ``args``; an attribute they lack reads as the default."""
        return cls(**_read(cls, args))


@dataclass(frozen=True, kw_only=True)
class TrainingProgress:
    """What Megatron's training sets on its arguments as it runs (none is a flag; None reads as 0)."""

    iteration: int = 0
    """The iteration Megatron's checkpoint load resumed from."""
    curr_iteration: int = 0
    """The iteration Megatron's training loop is running."""
    consumed_train_samples: int = 0
    """Training samples consumed so far (a resume's are restored from the checkpoint)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainingProgress":
        """The progress recorded on Megatron's ``args`` now."""
        return cls(**{name: value or 0 for name, value in _read(cls, args).items()})


def _read(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)}
