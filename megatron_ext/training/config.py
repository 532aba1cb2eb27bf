"""Flags of ``python -m megatron_ext.pretrain_gpt`` itself: :class:`EntryConfig`."""

import argparse as _argparse
from dataclasses import dataclass as _dataclass

from megatron_ext.config_registry import feature_config
from megatron_ext.replay.config import _is_number


@feature_config("entry: megatron_ext.pretrain_gpt")
@_dataclass(frozen=True, kw_only=True)
class EntryConfig:
    """Options of ``python -m megatron_ext.pretrain_gpt`` itself."""

    dry_run: bool = False
    """Validate every argument (Megatron's and megatron_ext's) for the world size of the launch
    (WORLD_SIZE), print the resolved configuration and exit, without initialising distributed
    training or touching a GPU (data files are only checked for existence)."""

    cpu: bool = False
    """Run the same Megatron training loop on CPU over gloo (try a launch script on a laptop, CI):
    implies --distributed-backend gloo and patches the loop's CUDA-only calls
    (megatron_ext.cpu_loop). Needs --transformer-impl local; Transformer Engine, CUDA graphs and
    NCCL are refused. With --fp8-format/--fp4-format it is a rehearsal: the model computes in
    fp32/bf16 while expert groups are aligned and checked exactly as the fp8/fp4 run's."""

    verbose: bool = False
    """Show every warning (missing Apex/Transformer Engine on CPU, CUDA_HOME, deprecations of
    what was chosen on purpose); by default megatron_ext hides warnings that do not apply."""

    def check_megatron_args(self, args: _argparse.Namespace) -> None:
        """Refuses what Megatron's data loader cannot run with megatron_ext's datasets."""
        if self.cpu:
            from megatron_ext.training.cpu_args import check_cpu_args

            check_cpu_args(args)
        from megatron_ext.training.vocab_check import check_vocabulary

        check_vocabulary(args)
        if (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1 and getattr(
            args, "route_replay_mode", "off"
        ) != "off":
            raise ValueError(
                "--route-replay-mode with --virtual-pipeline-model-parallel-size / "
                "--num-layers-per-virtual-pipeline-stage is not supported yet: replay binds one "
                "model stage per rank"
            )
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
            prefixes = [p for p in (getattr(args, "data_path", None) or []) if not _is_number(p)]
            per_split = [
                getattr(args, n, None)
                for n in ("train_data_path", "valid_data_path", "test_data_path")
            ]
            if not getattr(args, "pack_documents", False) or len(prefixes) != 1 or any(per_split):
                raise ValueError(
                    "--route-replay-mode record writes one route sidecar aligned with one token "
                    "dataset: it needs --pack-documents and exactly one --data-path prefix "
                    f"(got {len(prefixes)} prefixes)"
                )
        if packs_vary and getattr(args, "micro_batch_size", 1) > 1:
            raise ValueError(
                "--pack-documents without --pad-to-seq-len gives packs of different lengths, which "
                "Megatron's data loader cannot stack into one micro-batch: use --pad-to-seq-len "
                f"or --micro-batch-size 1 (got {args.micro_batch_size})"
            )
