"""Datasets provider for ``megatron_ext.pretrain_gpt``: Megatron's data arguments plus ours, built by
Megatron's ``BlendedMegatronDatasetBuilder`` from ``--data-path`` (weights, splits, per-split paths)
exactly as Megatron's ``pretrain_gpt.py`` builds them. Example::

    cls, config = dataset_config_from_args(args)
    train, valid, test = BlendedMegatronDatasetBuilder(cls, [100, 10, 10], lambda: True, config).build()
"""

import argparse
import dataclasses
from typing import Any

from megatron_ext.config.megatron_view import MegatronView, TrainingProgress
from megatron_ext.data import empty_split
from megatron_ext.training import run_state
from megatron_ext.training.feature_configs import PaddingConfig, PolicyLossConfig, ReplayConfig
from megatron_ext.training.policy_step import policy_sidecars


def pad_multiple_from_args(args: argparse.Namespace) -> int:
    """The pack-length multiple for the run (user value checked against CP, TP+SP and fp8/fp4)."""
    from megatron_ext.data.quantization_align import quantization_align_from_args

    return run_state.configs(args)[PaddingConfig].pad_multiple(
        context_parallel_size=args.context_parallel_size,
        tensor_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=bool(args.sequence_parallel),
        quantization_align=quantization_align_from_args(args),
    )


def doc_pad_multiple_from_args(args: argparse.Namespace) -> int:
    """Every packed document's length multiple for the run (2*CP under context parallelism)."""
    return PaddingConfig.doc_pad_multiple(args.context_parallel_size or 1)


def num_moe_layers(args: argparse.Namespace) -> int:
    """MoE layers in the main decoder (MTP excluded): ``--hybrid-layer-pattern``'s ``E`` layers for a
    HybridModel, else as ``--moe-layer-freq`` says."""
    from megatron_ext.replay.layout import moe_layer_numbers_for_args

    return len(moe_layer_numbers_for_args(args))


# Which dataset, from the flags:
#   --route-replay-mode replay (needs --pack-documents)  RoutedPackedDataset: packs + route sidecars
#   --route-replay-mode record --pack-documents          RoutedPackedDataset without routes (record
#                                                        scatters routes back by pack index)
#   --sft (Megatron's)     SelfPaddedSFTDataset: Megatron's SFTDataset, self-padded, --sft-packing
#   --pack-documents       PackedDataset: whole documents packed, self-padded, boundaries kept
#   --mock-data            Megatron's MockGPTDataset
#   otherwise              SelfPaddedGPTDataset: Megatron's GPTDataset with self-token padding
def dataset_config_from_args(args: argparse.Namespace, tokenizer: Any = None) -> tuple[type, Any]:
    """The dataset class and its config for ``args``."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    from megatron_ext.data.provider import dataset_class_and_config

    if tokenizer is None:
        from megatron.training import get_tokenizer

        tokenizer = get_tokenizer()
    cfgs = run_state.configs(args)
    padding, replay = cfgs[PaddingConfig], cfgs[ReplayConfig]
    view = MegatronView.from_args(args)
    common = _gpt_config_fields(args, view, tokenizer)
    if padding.pack_documents and replay.route_replay_mode != "off":
        return _routed_dataset_config(args, cfgs, common)
    if view.mock_data and not padding.pack_documents:
        return MockGPTDataset, GPTDatasetConfig(**common)
    if view.sft:  # Megatron's SFTDataset reads the CP size: each conversation padded to 2*CP
        common["context_parallel_size"] = view.context_parallel_size
    return dataset_class_and_config(
        padding,
        pad_multiple=pad_multiple_from_args(args),
        doc_pad_multiple=doc_pad_multiple_from_args(args),
        sidecars=policy_sidecars(cfgs[PolicyLossConfig]),
        sft=view.sft,
        **common,
    )


def _gpt_config_fields(args: argparse.Namespace, view: MegatronView, tokenizer: Any) -> dict:
    """The ``GPTDatasetConfig`` fields every dataset class shares, from Megatron's data flags."""
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    common: dict[str, Any] = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        # Megatron's own data flags, read by its dataset builder (and, for the document mask,
        # by the self-padded GPTDataset; packs always carry their document boundaries).
        multiple_validation_sets=view.multiple_validation_sets,
        full_validation=view.full_validation,
        num_dataset_builder_threads=view.num_dataset_builder_threads,
        mid_level_dataset_surplus=view.mid_level_dataset_surplus,
        object_storage_cache_path=view.object_storage_cache_path,
    )
    if view.dataloader_inter_document_masking:  # a flag and a field from megatron-core 0.19 on
        common["inter_document_masking"] = True
    return common


def _routed_dataset_config(
    args: argparse.Namespace, cfgs: dict[type, Any], common: dict[str, Any]
) -> tuple[type, Any]:
    """Route replay or record over packs: the packed config with the route sidecar's fields."""
    from megatron_ext.data.provider import dataset_class_and_config
    from megatron_ext.replay.route_dataset import RoutedPackedDataset, RoutedPackedDatasetConfig

    replay = cfgs[ReplayConfig]
    _, packed = dataset_class_and_config(
        cfgs[PaddingConfig],
        pad_multiple=pad_multiple_from_args(args),
        doc_pad_multiple=doc_pad_multiple_from_args(args),
        sidecars=policy_sidecars(cfgs[PolicyLossConfig]),  # --rl-loss: advantages, log-probs
        **common,
    )
    fields = {f.name: getattr(packed, f.name) for f in dataclasses.fields(packed) if f.init}
    # Replay reads route sidecars; record needs only the pack indices (no route suffix).
    replaying = replay.route_replay_mode == "replay"
    return RoutedPackedDataset, RoutedPackedDatasetConfig(
        **fields,
        route_suffix=replay.route_data_suffix if replaying else None,
        route_num_layers=num_moe_layers(args),
        route_topk=args.moe_router_topk,
        route_num_experts=args.num_experts,
        route_missing_policy=replay.replay_missing_route_policy,
        route_filled_mask=replay.route_replay_check,
    )


class DataRefusedError(Exception):
    """Bad data found while Megatron's ``pretrain`` builds the datasets (a ``ValueError`` of the
    dataset checks, naming the file or flag): the entry prints it in one line and exits 2."""


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int], vp_stage: int | None = None
) -> tuple[Any, Any, Any]:
    """Builds train/valid/test datasets (Megatron's ``train_valid_test_dataset_provider`` signature).

    Raises:
        DataRefusedError: a dataset check refused the data (what only the built datasets show:
            a split rounding to no document, a replay sidecar covering too few rows, a pack-index
            cache that cannot be written, ...).
    """
    try:
        return _build_datasets(train_val_test_num_samples)
    except ValueError as err:
        raise DataRefusedError(str(err)) from err


def _build_datasets(train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.training import get_args, print_rank_0

    args = get_args()
    view = MegatronView.from_args(args)
    # Record mode: refuse, before the datasets are built, ranks that would stream routes where
    # rank 0 cannot read them (collective over the recording data-parallel group).
    run_state.check_record_directory(args)
    dataset_cls, config = dataset_config_from_args(args)
    print_rank_0(f"> megatron_ext: building {dataset_cls.__name__} train/valid/test datasets")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_cls, train_val_test_num_samples, lambda: True, config
    ).build()
    # A split without a sample (its share of the documents rounds to none, and nothing is asked
    # of it: asking is refused by the datasets) is no split: Megatron builds no loader for None,
    # where an empty dataset fails its sampler ("no sample to consume: 0") before training.
    datasets = [None if d is not None and len(d) == 0 else d for d in datasets]
    if view.full_validation and datasets[1] is None:
        # An absent split (a 0 weight) was refused at argument time (eval_args); this one rounded
        # to no documents, which only the built datasets show.
        raise empty_split.full_validation_error(args.split, args.data_path, view.data_args_path)
    replay, run = run_state.configs(args)[ReplayConfig], run_state.state(args)
    if replay.route_replay_mode == "record":
        run.record_dataset = datasets[0]
    # Megatron builds the datasets once per virtual pipeline stage, of the same data: checked and
    # logged once per launch (a second line would say an earlier launch counted what this one did).
    if (
        replay.route_replay_mode == "replay"
        and datasets[0] is not None
        and not run.route_coverage_checked
    ):
        from megatron_ext.replay.route_coverage import check_route_coverage

        run.route_coverage_checked = True
        check_route_coverage(  # the samples this run trains on: from a resume's to the last
            datasets[0],
            TrainingProgress.from_args(args).consumed_train_samples,
            train_val_test_num_samples[0],
            replay.route_replay_max_missing,
            log=print_rank_0,
            cache=True,  # beside the pack plans: counted once per data, not per launch
        )
    return datasets


# Megatron's training loop builds the data loader on every rank that returns True here: every rank
# of a data-parallel replica builds the datasets (deterministic and index-cached), so each
# tensor-parallel rank reads the same samples itself instead of relying on Megatron's TP broadcast,
# which only carries Megatron's own keys.
train_valid_test_datasets_provider.is_distributed = True
