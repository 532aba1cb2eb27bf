"""Flags of ``python -m megatron_ext.pretrain_gpt`` itself: :class:`EntryConfig`.

What the entry point refuses across features is checked in :mod:`megatron_ext.training.launch_rules`.
"""

from dataclasses import dataclass as _dataclass

from megatron_ext.config.registry import feature_config


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
    (megatron_ext.cpu.training_loop). Needs --transformer-impl local; Transformer Engine, CUDA graphs and
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
