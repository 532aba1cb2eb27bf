"""Flags of ``python -m megatron_ext.pretrain_gpt`` itself: :class:`EntryConfig`."""

import argparse as _argparse
from dataclasses import dataclass as _dataclass

from megatron_ext.config_registry import feature_config


@feature_config("entry: megatron_ext.pretrain_gpt")
@_dataclass(frozen=True, kw_only=True)
class EntryConfig:
    """Options of ``python -m megatron_ext.pretrain_gpt`` itself."""

    dry_run: bool = False
    """Validate every argument (Megatron's and megatron_ext's) for the world size of the launch
    (WORLD_SIZE, default 1: set it to the job's; the example scripts set NNODES x GPUS_PER_NODE),
    print the resolved configuration and exit, without initialising distributed training or
    touching a GPU (data files are checked to exist, route files to match the model)."""

    cpu: bool = False
    """Run the same Megatron training loop on CPU over gloo (try a launch script on a laptop, CI):
    implies --distributed-backend gloo and patches the loop's CUDA-only calls
    (megatron_ext.cpu_loop). Needs --transformer-impl local; Transformer Engine, CUDA graphs and
    NCCL are refused. With --fp8-format/--fp4-format it is a rehearsal: the model computes in
    fp32 while expert groups are aligned and checked exactly as the fp8/fp4 run's."""

    cpu_caching_malloc: bool = True
    """Under --cpu, make glibc malloc keep freed memory for reuse (no mmap'd chunks, no trimming
    of the heap), as a GPU caching allocator keeps its blocks: a fresh CPU tensor otherwise faults
    in every page on every step. It changes no result. --no-cpu-caching-malloc keeps glibc's
    defaults; a launch without --cpu never changes them."""

    verbose: bool = False
    """Show everything Megatron prints: every warning (missing Apex/Transformer Engine on CPU,
    CUDA_HOME, deprecations of what was chosen on purpose), its INFO logs, its argument dump, the
    lines that do not apply to the run (memory on CPU, estimates it cannot make) and an argument
    error's whole traceback. By default megatron_ext hides what does not apply, keeps Megatron's
    logs at WARNING unless --logging-level or MEGATRON_LOGGING_LEVEL sets a level, prints a short
    configuration instead of the dump, and reports a refusal in one line."""

    log_arguments: bool = False
    """Print Megatron's full argument dump (every argument, about 840 lines) after validation, as
    Megatron does by default; without it a launch prints a four-line configuration (model,
    parallelism, data, the megatron_ext flags set)."""

    allow_untested_megatron: bool = False
    """Run even though the installed megatron-core is not a version megatron_ext was tested on, or
    a Megatron function megatron_ext patches or copies changed since (a launch refuses both, naming
    the version and the functions; docs/compat.md says how to check a new version)."""

    def check_megatron_args(self, args: _argparse.Namespace) -> None:
        """Refuses what Megatron's data loader cannot run with megatron_ext's datasets."""
        if self.cpu:
            from megatron_ext.training.cpu_args import check_cpu_args

            check_cpu_args(args)
        from megatron_ext.training.vocab_check import check_vocabulary

        check_vocabulary(args)
        from megatron_ext.replay.unsupported import check_virtual_pipeline

        check_virtual_pipeline(args)
        packs_vary = getattr(args, "pack_documents", False) and not getattr(
            args, "pad_to_seq_len", False
        )
        if (getattr(args, "context_parallel_size", 1) or 1) > 1:
            raise ValueError(
                "megatron_ext.pretrain_gpt does not support --context-parallel-size > 1 yet: its "
                "forward step does not slice megatron_ext's batches (pad mask, document boundaries, "
                "routes) for context parallelism"
            )
        if getattr(args, "route_replay_mode", "off") == "record":
            from megatron_ext.data.data_args import data_prefixes

            found = data_prefixes(args)
            prefixes = [p for _flag, group, _weights in found for p in group]
            per_split = [f for f, _, _ in found if not f.startswith(("--data-path", "--data-args"))]
            if not getattr(args, "pack_documents", False) or len(prefixes) != 1 or per_split:
                raise ValueError(
                    "--route-replay-mode record writes one route sidecar aligned with one token "
                    "dataset: it needs --pack-documents and exactly one --data-path prefix "
                    f"(got {len(prefixes)} prefixes)"
                )
        for dest, flag in (
            ("micro_batch_size", "--micro-batch-size"),
            ("eval_micro_batch_size", "--eval-micro-batch-size"),
        ):
            size = getattr(args, dest, None) or 1
            if packs_vary and size > 1:
                raise ValueError(
                    "--pack-documents without --pad-to-seq-len gives packs of different lengths, "
                    "which Megatron's data loader cannot stack into one micro-batch: use "
                    f"--pad-to-seq-len or {flag} 1 (got {size})"
                )
        _refuse_unsupported(args)


#: Megatron flags the entry point cannot honour: (dest, flag, why). Each is refused when set.
_ENTRY_UNSUPPORTED: tuple[tuple[str, str, str], ...] = (
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
     "Megatron's combined 1F1B schedule calls forward_step with return_schedule_plan and routes "
     "without the pad mask, bypassing pad skipping, alignment and replay"),
    ("sft", "--sft", "megatron_ext builds its own packed datasets, not Megatron's SFTDataset: "
     "use --pack-documents with --pack-loss-mask-suffix for SFT data"),
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


def _refuse_unsupported(args: _argparse.Namespace) -> None:
    """Refuses the Megatron flags and combinations ``megatron_ext.pretrain_gpt`` cannot run."""
    for dest, flag, why in _ENTRY_UNSUPPORTED:
        if getattr(args, dest, False):
            raise ValueError(f"megatron_ext.pretrain_gpt does not support {flag}: {why}")
    train_iters = getattr(args, "train_iters", None)
    if train_iters is not None and train_iters < 1 and not getattr(args, "skip_train", False):
        raise ValueError(
            f"--train-iters must be at least 1, got {train_iters} (Megatron fails after building "
            "the model otherwise; --skip-train evaluates without training)"
        )
    from megatron_ext.replay.unsupported import load_balancing_types

    moe = bool(getattr(args, "num_experts", None))
    if moe and "quantile_balancing" in load_balancing_types(args):
        raise ValueError(
            "--moe-router-load-balancing-type quantile_balancing is not supported: Megatron 0.19.2's "
            "quantile balancing refuses a padding mask, and megatron_ext hands every router one"
        )
    if getattr(args, "mock_data", False):
        for dest, flag in (
            ("pack_documents", "--pack-documents"),
            ("pad_to_seq_len", "--pad-to-seq-len"),
        ):
            if getattr(args, dest, False):
                raise ValueError(
                    f"--mock-data cannot be combined with {flag}: megatron_ext's datasets read "
                    "real token files (Megatron's mock dataset is used with --mock-data alone)"
                )
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1 and getattr(
        args, "route_replay_mode", "off"
    ) == "record":
        raise ValueError(
            "--route-replay-mode record with --pipeline-model-parallel-size > 1 is not supported "
            "yet: gathering each micro-batch's routes over the pipeline stages inside the "
            "schedule would deadlock (record at PP=1, then replay at any PP)"
        )
    if moe and getattr(args, "mtp_num_layers", None):
        _refuse_with_mtp(args)


def _refuse_with_mtp(args: _argparse.Namespace) -> None:
    """Megatron builds the MTP block's layers from its own specs, so megatron_ext's MoE layer and
    router never reach them: what needs them there is refused, naming both flags. (Pad skipping
    still applies to the decoder's MoE layers; the MTP layers route pads as Megatron does.)"""
    needs_ours = (
        ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias",
         "Megatron's own router counts fail on the pad mask in MTP layers"),
        ("moe_dispatch_align", "--moe-dispatch-align", "MTP layers would not be aligned by it"),
        ("moe_expert_load_metrics", "--moe-expert-load-metrics",
         "MTP layers would not be counted"),
    )  # fmt: skip
    for dest, flag, why in needs_ours:
        if getattr(args, dest, False):
            raise ValueError(f"--mtp-num-layers with {flag} is not supported: {why}")
    if getattr(args, "route_replay_mode", "off") != "off":
        raise ValueError(
            "--mtp-num-layers with --route-replay-mode is not supported: MTP layers' routers "
            "would route natively"
        )
