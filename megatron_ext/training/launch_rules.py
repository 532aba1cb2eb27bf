"""The one validation path of a launch, and the rules that span features (cross-feature checks).

Each feature checks its own config (``__post_init__``, ``check_megatron_args``); what combines
several features, or megatron_ext with Megatron flags the entry point cannot honour, lives here.
Example::

    configs = validate(args, launch=True)   # ValueError naming the flag(s) on the first refusal
    configs[PaddingConfig].pack_documents
"""

import argparse
import dataclasses
import weakref
from typing import Any

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import flag_value
from megatron_ext.training import feature_configs as _config

#: The arguments :func:`validate` last checked and what it returned (checked once per launch).
_LAST: tuple[Any, dict[type, Any]] | None = None


def validate(args: argparse.Namespace, *, launch: bool = False) -> dict[type, Any]:
    """Builds every feature config from ``args`` and runs every argument-time check once.

    Args:
        args: Megatron's parsed (and validated) arguments with megatron_ext's flags.
        launch: Also run the checks of a ``megatron_ext.pretrain_gpt`` launch (expert grid,
            evaluation interval, ``--split``, validation data), before the data scans.

    Returns:
        ``{ConfigClass: instance}`` for every registered feature.

    Raises:
        ValueError: The first refused value or combination; the message names the flag(s).
    """
    global _LAST
    # One order: what --cpu cannot run, the cheap launch checks, each feature, the vocabulary
    # scan, the combinations.
    if _LAST is not None and _LAST[0]() is args:
        return _LAST[1]
    if flag_value(args, "cpu"):  # what --cpu cannot run is named first
        from megatron_ext.training.cpu_args import check_cpu_args

        check_cpu_args(args)
    if launch:
        from megatron_ext.training.eval_args import check_evaluation_data, check_split
        from megatron_ext.training.launch_args import check_launch_args

        check_launch_args(args)  # cheap, before the data scans of the config checks
        check_split(args)  # before Megatron's split math reads it
        check_evaluation_data(args)  # Megatron's pretrain would crash in its first evaluation
    configs = feature_configs(args)
    from megatron_ext.training.vocab_check import check_vocabulary

    check_vocabulary(args)
    check_combinations(args)
    if launch:  # the providers ask again for the same arguments: nothing runs twice
        _LAST = (weakref.ref(args), configs)
    return configs


def feature_configs(args: argparse.Namespace) -> dict[type, Any]:
    """Each feature's config from ``args``, validated by the feature itself (``__post_init__`` and
    its ``check_megatron_args``); raises ``ValueError`` naming the flag."""
    configs: dict[type, Any] = {}
    for cls in _config.FEATURE_CONFIGS:
        kwargs = {  # the builder of the feature configs: a flag missing from args is refused
            f.name: getattr(args, f.name, _MISSING) for f in dataclasses.fields(cls) if f.init
        }
        missing = [_config.flag(name) for name, value in kwargs.items() if value is _MISSING]
        if missing:
            raise ValueError(
                f"arguments lack megatron_ext flags {missing}: add add_megatron_ext_args"
            )
        instance = cls(**kwargs)
        check = getattr(instance, "check_megatron_args", None)
        if check is not None:
            check(args)
        configs[cls] = instance
    return configs


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def check_combinations(args: argparse.Namespace) -> None:
    """Refuses the combinations of features (and of megatron_ext with Megatron's flags) that
    ``megatron_ext.pretrain_gpt`` cannot run, naming the flags."""
    from megatron_ext.replay.unsupported import check_virtual_pipeline
    from megatron_ext.training.sft_args import check_sft_args

    check_virtual_pipeline(args)
    check_sft_args(args)
    view = MegatronView.from_args(args)
    pack_documents = flag_value(args, "pack_documents")
    packs_vary = pack_documents and not flag_value(args, "pad_to_seq_len")
    if (view.context_parallel_size or 1) > 1:
        _refuse_with_context_parallel(view)
    if flag_value(args, "route_replay_mode") == "record":
        from megatron_ext.data.data_args import data_prefixes

        found = data_prefixes(args)
        prefixes = [p for _flag, group, _weights in found for p in group]
        per_split = [f for f, _, _ in found if not f.startswith(("--data-path", "--data-args"))]
        if not pack_documents or len(prefixes) != 1 or per_split:
            raise ValueError(
                "--route-replay-mode record writes one route sidecar aligned with one token "
                "dataset: it needs --pack-documents and exactly one --data-path prefix "
                f"(got {len(prefixes)} prefixes)"
            )
    for size, flag in (
        (view.micro_batch_size, "--micro-batch-size"),
        (view.eval_micro_batch_size, "--eval-micro-batch-size"),
    ):
        size = size or 1
        if packs_vary and size > 1:
            raise ValueError(
                "--pack-documents without --pad-to-seq-len gives packs of different lengths, "
                "which Megatron's data loader cannot stack into one micro-batch: use "
                f"--pad-to-seq-len or {flag} 1 (got {size})"
            )
    _refuse_unsupported(args, view)


#: Megatron flags the entry point cannot honour: (dest, flag, why). Each is refused when set.
_ENTRY_UNSUPPORTED: tuple[tuple[str, str, str], ...] = (
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
     "Megatron's combined 1F1B schedule calls forward_step with return_schedule_plan and routes "
     "without the pad mask, bypassing pad skipping, alignment and replay"),
    ("fim_data", "--fim-data", "megatron_ext builds no GPTFIMDataset"),
    ("dataloader_fast_cache_load", "--dataloader-fast-cache-load",
     "megatron_ext's datasets key their index caches by the data and always check them"),
    ("dataloader_defer_npy_index_mmap", "--dataloader-defer-npy-index-mmap",
     "megatron_ext's datasets do not defer their index loads"),
    ("per_dataset_sequences_path", "--per-dataset-sequences-path",
     "megatron_ext's datasets count their own sequences"),
    ("rampup_batch_size", "--rampup-batch-size",
     "Megatron-Core 0.19.2 accepts it and ignores it (deprecated): every step would run the full "
     "--global-batch-size. Use --step-batch-size-schedule (without --global-batch-size)"),
)  # fmt: skip


def _refuse_unsupported(args: argparse.Namespace, view: MegatronView) -> None:
    """Refuses the Megatron flags and combinations ``megatron_ext.pretrain_gpt`` cannot run."""
    for dest, flag, why in _ENTRY_UNSUPPORTED:
        if getattr(view, dest):
            raise ValueError(f"megatron_ext.pretrain_gpt does not support {flag}: {why}")
    train_iters = view.train_iters
    if train_iters is not None and train_iters < 1 and not view.skip_train:
        raise ValueError(
            f"--train-iters must be at least 1, got {train_iters} (Megatron fails after building "
            "the model otherwise; --skip-train evaluates without training)"
        )
    from megatron_ext.replay.unsupported import load_balancing_types

    moe = bool(view.num_experts)
    if moe and "quantile_balancing" in load_balancing_types(args):
        raise ValueError(
            "--moe-router-load-balancing-type quantile_balancing is not supported: Megatron 0.19.2's "
            "quantile balancing refuses a padding mask, and megatron_ext hands every router one"
        )
    if view.mock_data:
        for dest, flag in (
            ("pack_documents", "--pack-documents"),
            ("pad_to_seq_len", "--pad-to-seq-len"),
        ):
            if flag_value(args, dest):
                raise ValueError(
                    f"--mock-data cannot be combined with {flag}: megatron_ext's datasets read "
                    "real token files (Megatron's mock dataset is used with --mock-data alone)"
                )
    recording = flag_value(args, "route_replay_mode") == "record"
    if (view.pipeline_model_parallel_size or 1) > 1 and recording:
        raise ValueError(
            "--route-replay-mode record with --pipeline-model-parallel-size > 1 is not supported "
            "yet: gathering each micro-batch's routes over the pipeline stages inside the "
            "schedule would deadlock (record at PP=1, then replay at any PP)"
        )
    if moe and view.mtp_num_layers:
        _refuse_with_mtp(args, view)


def _refuse_with_context_parallel(view: MegatronView) -> None:
    """What ``--context-parallel-size > 1`` cannot run with: the forward step splits each
    micro-batch with Megatron's ``get_batch_on_this_cp_rank`` (packed samples per document, with
    the document boundaries the packs pad to ``2 * CP``; others by the per-sequence zigzag)."""
    if view.hybrid_context_parallel:
        raise ValueError(
            "--context-parallel-size > 1 with --hybrid-context-parallel is not supported: the "
            "forward step splits micro-batches over the fixed CP group (Megatron's hybrid CP "
            "schedule picks a CP size per micro-batch)"
        )
    if view.dataloader_inter_document_masking:
        raise ValueError(
            "--context-parallel-size > 1 with --dataloader-inter-document-masking is not "
            "supported: Megatron splits document boundaries per document, which needs each "
            "document padded to 2 * CP; use --pack-documents (its packs pad every document)"
        )


def _refuse_with_mtp(args: argparse.Namespace, view: MegatronView) -> None:
    """Megatron builds the MTP block's layers from its own specs, so megatron_ext's MoE layer and
    router never reach them: what needs them there is refused, naming both flags. (Pad skipping
    still applies to the decoder's MoE layers; the MTP layers route pads as Megatron does.)"""
    needs_ours = (
        (view.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias",
         "Megatron's own router counts fail on the pad mask in MTP layers"),
        (flag_value(args, "moe_dispatch_align"), "--moe-dispatch-align",
         "MTP layers would not be aligned by it"),
        (flag_value(args, "moe_expert_load_metrics"), "--moe-expert-load-metrics",
         "MTP layers would not be counted"),
    )  # fmt: skip
    for is_set, flag, why in needs_ours:
        if is_set:
            raise ValueError(f"--mtp-num-layers with {flag} is not supported: {why}")
    if flag_value(args, "route_replay_mode") != "off":
        raise ValueError(
            "--mtp-num-layers with --route-replay-mode is not supported: MTP layers' routers "
            "would route natively"
        )
