"""The compatibility table: every change megatron_ext makes to Megatron-Core's behaviour, one row each.

Groups (what applies them):

- ``cpu.*``, ``cpu_loop.*`` (:mod:`megatron_ext.compat.cpu_rows`): ``enable_cpu_mode`` /
  ``enable_cpu_training``: Megatron's model stack and training loop on CPU / gloo.
- ``launch``: every ``megatron_ext.pretrain_gpt`` training launch, GPU included (the rows that read
  the run's arguments read them when Megatron calls the function).
- ``validate_on_target``, ``fp4_rehearsal``, ``dry_run_target``: argument validation of a ``--cpu``
  or ``--dry-run`` launch on a machine without the target GPU or Transformer Engine, for the length
  of the check only.
- ``owned``: applied by the object named in the reason (per model, undone by it); ``copied``: a
  Megatron body copied and edited in megatron_ext, fingerprinted so an upstream change is noticed.

:func:`megatron_ext.compat.check.check_megatron` compares, at startup, the fingerprint of every row the
launch applies (a value that is not Megatron's code, such as an optional Transformer Engine kernel,
by what the row needs of it: :class:`~megatron_ext.compat.patch.Needs`).
"""

from megatron_ext.compat.cpu_rows import CPU_ROWS, LOOP_ROWS
from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Needs, Patch

M = "megatron.core."
T = "megatron.training."

OTHER_ROWS: list[Patch] = [
    Patch("launch", M + "datasets.utils", "compile_helpers",
          "megatron_ext.training.startup:compile_only_without_prebuilt",
          "runs make on every launch; the 0.19.2 wheel ships helpers_cpp but no Makefile",
          "6891d190987884a0"),
    Patch("launch", T + "training", "training_log",
          "megatron_ext.training.loss_log:resetting_after_regular_first_line",
          "a first logged iteration on the schedule does not reset the loss sums",
          "2da9e48509db96c4"),
    Patch("launch", T + "training", "load_checkpoint",
          "megatron_ext.training.checkpoint_checks:exiting_nonzero",
          "a failed load exits with a bare sys.exit() (status 0)", "8f460d583f0bbf80"),
    Patch("launch", T + "training", "save_checkpoint",
          "megatron_ext.training.checkpoint_save:failing_in_one_line",
          "a failed save ends in tracebacks on every rank", "ce51bc5c0ad82c65"),
    Patch("launch", M + "dist_checkpointing.strategies.filesystem_async",
          "FileSystemWriterAsync.write_preloaded_data",
          "megatron_ext.training.checkpoint_save:recording_write_errors",
          "the torch_dist writer keeps only the class of a failed write's OSError (no file, no "
          "errno: a full disk never says so)", "8364a85920565d66"),
    Patch("launch", M + "optimizer.optimizer", "MegatronOptimizer._filter_and_reorder_param_groups",
          "megatron_ext.training.resume_checks:matching_groups_across_lr",
          "keys the saved param groups by max_lr/min_lr too: a resume with another --lr finds no "
          "group ('Could not find parameter group') even with the scheduler flags",
          "dc405c26824a0b9d"),
    Patch("validate_on_target", T + "arguments", "validate_args",
          HostTorch(cuda=("get_device_capability",)),
          "--moe-grouped-gemm asks the CUDA device's capability: the target's (9.0) instead",
          "a6b2fd0a77a7ceec"),
    Patch("validate_on_target", T + "arguments", "get_device_arch_version",
          "megatron_ext.cpu.model_stack:target_arch_version", "TP/CP > 1 asks the CUDA device's architecture",
          "2727950b6827d63b"),
    Patch("fp4_rehearsal", T + "arguments", "is_te_min_version",
          "megatron_ext.pretrain_gpt:passing_nvfp4_te_check",
          "--fp4-format requires Transformer Engine >= 2.7, which a --cpu rehearsal never runs",
          "50cbdaa14235331a"),
    Patch("dry_run_target", M + "transformer.transformer_config", "is_te_min_version",
          "megatron_ext.training.dry_run:current_te",
          "a dry run without Transformer Engine validates as the target with a current one",
          "50cbdaa14235331a"),
    Patch("dry_run_target", M + "models.common.embeddings.rope_utils",
          "fused_apply_rotary_pos_emb", "megatron_ext.training.dry_run:on_the_target_only",
          "a dry run's checks ask whether the fused RoPE kernel is there (Megatron binds it to "
          "Transformer Engine's kernel where TE imports, else None: checked by kind)",
          Needs(("callable", "None"))),
    Patch("owned", M + "transformer.moe.router_replay", "RouterReplay",
          None, "route replay swaps KeyedRouterReplay into RouterReplay.global_router_replay_instances "
          "(megatron_ext.replay.keyed_router_replay.swap_in; RouteReplayBinding.remove undoes it)",
          "66dce7a4db535981"),
    Patch("owned", T + "global_vars", "get_args", None,
          "the resume checks set _GLOBAL_ARGS, which get_args returns, to a copy of the run's "
          "arguments for the length of a check (megatron_ext.training.resume_checks.megatron_args)",
          "6d17a5a434280b25"),
    Patch("owned", T + "training", "_TRAIN_START_TIME", None,
          "a rank forked from the tests' preloaded server sets Megatron's start clocks "
          "(_TRAIN_START_TIME, _LEGACY_TRAIN_START_TIME) to its own start "
          "(megatron_ext.rehearse.rank_server)", Needs(("float",))),
    Patch("launch", T + "arguments", "_print_args",
          "megatron_ext.training.launch_log:dump_only_when_asked",
          "the argument dump (about 840 lines) prints only with --log-arguments or --verbose "
          "(also for the length of parsing: megatron_ext.training.launch_log.argument_dump_when_asked)",
          "8a36ca04315ab55f"),
    Patch("launch", T + "training", "report_memory",
          "megatron_ext.training.launch_log:memory_report_where_it_applies",
          "without CUDA every number is 0.00: left out unless --log-memory-interval asks for it",
          "b06092c071ec7d17"),
    Patch("launch", T + "training", "report_theoretical_memory",
          "megatron_ext.training.launch_log:estimate_where_there_is_one",
          "a HybridModel only prints that it has no estimate: left out for one", "bc3e9d955cf15308"),
    Patch("launch", M + "dist_checkpointing.strategies.torch", "TorchDistSaveShardedStrategy.save",
          "megatron_ext.training.launch_log:save_without_async_deprecation",
          "logs the async-save deprecation on every synchronous save: that one record is dropped "
          "while it saves when --async-save is off", "e49585f4e59242fe"),
    Patch("copied", M + "transformer.moe.token_dispatcher",
          "MoEAlltoAllTokenDispatcher.dispatch_preprocess", None,
          "copied and edited in megatron_ext.moe.token_dispatcher (the pad folded into the permute)",
          "a4ba9a56bc9e95e0"),
]  # fmt: skip

#: Every row, in the order applied.
TABLE: tuple[Patch, ...] = (*CPU_ROWS, *LOOP_ROWS, *OTHER_ROWS)


def rows(*groups: str) -> list[Patch]:
    """The rows of ``groups`` (a group ``"cpu"`` names every ``cpu.*`` row), in table order."""
    unknown = [
        g for g in groups if not any(r.group.split(".")[0] == g or r.group == g for r in TABLE)
    ]
    assert not unknown, f"no compatibility rows in group(s) {unknown}"
    return [r for r in TABLE if r.group in groups or r.group.split(".")[0] in groups]


def row(name: str) -> Patch:
    """The row of ``module.attribute`` ``name`` applied by a factory (not a :class:`HostTorch` row)."""
    found = [r for r in TABLE if r.name == name and not isinstance(r.replacement, HostTorch)]
    assert len(found) == 1, f"{len(found)} compatibility rows for {name}"
    return found[0]
