"""The compatibility table: every change megatron_ext makes to Megatron-Core's behaviour, one row each.

The groups and what applies each are in docs/compat.md (a test keeps its table equal to this one).
"""

from megatron_ext.compat.cpu_rows import CPU_ROWS, LOOP_ROWS
from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Needs, Patch
from megatron_ext.compat.versions import table_version

M = "megatron.core."
T = "megatron.training."

# A factory is named as a string ("megatron_ext.training.checkpoint_checks:exiting_nonzero") and
# lives beside the feature it belongs to, so this table imports none of them and compat/ imports no
# feature. The launch rows that read the run's arguments read them when Megatron calls the function.
OTHER_ROWS: list[Patch] = [
    Patch(
        group="launch", module=M + "datasets.utils", attribute="compile_helpers",
        replacement="megatron_ext.training.startup:compile_only_without_prebuilt",
        reason="runs make on every launch; the 0.19.2 wheel ships helpers_cpp but no Makefile",
        depends_on=('"make"',), fingerprint="87a7db118f42b6c2",
    ),
    Patch(
        group="launch", module=T + "training", attribute="training_log",
        replacement="megatron_ext.training.loss_log:resetting_after_regular_first_line",
        reason="a first logged iteration on the schedule does not reset the loss sums",
        depends_on=("should_reset = not is_first_iteration",), fingerprint="64581b1cedb54973",
    ),
    Patch(
        group="launch", module=T + "training", attribute="load_checkpoint",
        replacement="megatron_ext.training.checkpoint_checks:exiting_nonzero",
        reason="a failed load exits with a bare sys.exit() (status 0)", depends_on=("sys.exit()",),
        fingerprint="0308bfe5a29362e4",
    ),
    Patch(
        group="launch", module=T + "training", attribute="save_checkpoint",
        replacement="megatron_ext.training.checkpoint_save:failing_in_one_line",
        reason="a failed save ends in tracebacks on every rank",
        fingerprint={"0.18.2": "f4a476f1624e93fe", "0.19.2": "ce51bc5c0ad82c65"},
    ),
    Patch(
        group="launch", module=M + "dist_checkpointing.strategies.filesystem_async",
        attribute="FileSystemWriterAsync.write_preloaded_data",
        replacement="megatron_ext.training.checkpoint_save:recording_write_errors",
        reason="the torch_dist writer keeps only the class of a failed write's OSError (no file, "
               "no errno: a full disk never says so)",
        depends_on=("except Exception as e", "local_output = (local_proc_idx, e)"),
        fingerprint="4e62711da13049b0",
    ),
    Patch(
        group="launch", module=M + "optimizer.optimizer",
        attribute="MegatronOptimizer._filter_and_reorder_param_groups",
        replacement="megatron_ext.training.resume_checks:matching_groups_across_lr",
        reason="0.19.2 keys the saved param groups by max_lr/min_lr too: a resume with another "
               "--lr finds no group ('Could not find parameter group') even with the scheduler "
               "flags; 0.18.2 pairs them without but keeps the checkpoint's LR in them (a new "
               "--lr ignored under --override-opt_param-scheduler)",
        fingerprint={"0.18.2": "cec96b015796fb30", "0.19.2": "dc405c26824a0b9d"},
    ),
    *[
        Patch(
            group="launch", module=M + module, attribute="get_tokens_per_expert_and_token_count",
            replacement="megatron_ext.moe.router:local_count_before_the_reduce",
            reason="with a padding mask, this rank's token count is read after the in-place "
                   "all-reduce over TP x CP: the per-token-loss aux-loss gradient is CP (SP: TP) "
                   "times too large" + (" (the router's own import)" if module.endswith("router")
                                        else ""),
            depends_on=("local_num_tokens = local_tokens_per_expert.sum() / topk",),
            fingerprint="fd19e6136b12d6c9",
        )
        for module in ("transformer.moe.moe_utils", "transformer.moe.router")
    ],
    Patch(
        group="validate_on_target", module=T + "arguments", attribute="validate_args",
        replacement=HostTorch(cuda=("get_device_capability",)),
        reason="--moe-grouped-gemm asks the CUDA device's capability: the target's (9.0) instead",
        fingerprint="3fc0e5b77700f3a4",
    ),
    Patch(
        group="validate_on_target", module=T + "arguments", attribute="get_device_arch_version",
        replacement="megatron_ext.cpu.model_stack:target_arch_version",
        reason="TP/CP > 1 asks the CUDA device's architecture", fingerprint="2727950b6827d63b",
    ),
    Patch(
        group="fp4_rehearsal", module=T + "arguments", attribute="is_te_min_version",
        replacement="megatron_ext.pretrain_gpt:passing_nvfp4_te_check",
        reason="--fp4-format requires Transformer Engine >= 2.7, which a --cpu rehearsal never "
               "runs",
        fingerprint="50cbdaa14235331a",
    ),
    Patch(
        group="dry_run_target", module=M + "transformer.transformer_config",
        attribute="is_te_min_version", replacement="megatron_ext.training.dry_run:current_te",
        reason="a dry run without Transformer Engine validates as the target with a current one",
        fingerprint="50cbdaa14235331a",
    ),
    Patch(
        group="dry_run_target", module=M + "models.common.embeddings.rope_utils",
        attribute="fused_apply_rotary_pos_emb",
        replacement="megatron_ext.training.dry_run:on_the_target_only",
        reason="a dry run's checks ask whether the fused RoPE kernel is there (Megatron binds it "
               "to Transformer Engine's kernel where TE imports, else None: checked by kind)",
        fingerprint=Needs(("callable", "None")),
    ),
    Patch(
        group="owned", module=M + "transformer.moe.router_replay", attribute="RouterReplay",
        replacement=None,
        reason="route replay swaps KeyedRouterReplay into "
               "RouterReplay.global_router_replay_instances "
               "(megatron_ext.replay.keyed_router_replay.swap_in; RouteReplayBinding.remove undoes"
               " it)",
        # 0.19.2 adds the attribute layer_number (KeyedRouterReplay sets its own on both).
        fingerprint={"0.18.2": "1357c3f7b7104f57", "0.19.2": "66dce7a4db535981"},
    ),
    Patch(
        group="owned", module=T + "global_vars", attribute="get_args", replacement=None,
        reason="the resume checks set _GLOBAL_ARGS, which get_args returns, to a copy of the "
               "run's arguments for the length of a check "
               "(megatron_ext.training.resume_checks.megatron_args)",
        fingerprint="6d17a5a434280b25",
    ),
    Patch(
        group="owned", module=T + "training", attribute="_TRAIN_START_TIME", replacement=None,
        reason="a rank forked from the tests' preloaded server sets Megatron's start clocks "
               "(_TRAIN_START_TIME, _LEGACY_TRAIN_START_TIME) to its own start "
               "(megatron_ext.rehearse.rank_server)",
        fingerprint=Needs(("float",)),
    ),
    Patch(
        group="launch", module=T + "arguments", attribute="_print_args",
        replacement="megatron_ext.training.launch_log:dump_only_when_asked",
        reason="the argument dump (about 840 lines) prints only with --log-arguments or --verbose"
               " (also for the length of parsing: "
               "megatron_ext.training.launch_log.argument_dump_when_asked)",
        fingerprint="8a36ca04315ab55f",
    ),
    Patch(
        group="launch", module=T + "training", attribute="report_memory",
        replacement="megatron_ext.training.launch_log:memory_report_where_it_applies",
        reason="without CUDA every number is 0.00: left out unless --log-memory-interval asks for"
               " it",
        depends_on=("torch.cuda.memory_allocated()",), fingerprint="fc3dbf9bd4d981d6",
    ),
    Patch(
        group="launch", module=T + "training", attribute="report_theoretical_memory",
        replacement="megatron_ext.training.launch_log:estimate_where_there_is_one",
        reason="a HybridModel only prints that it has no estimate: left out for one",
        fingerprint="bc3e9d955cf15308",
    ),
    Patch(
        group="launch", module=M + "dist_checkpointing.strategies.torch",
        attribute="TorchDistSaveShardedStrategy.save",
        replacement="megatron_ext.training.launch_log:save_without_async_deprecation",
        reason="logs the async-save deprecation on every synchronous save: that one record is "
               "dropped while it saves when --async-save is off",
        fingerprint="e49585f4e59242fe",
    ),
    Patch(
        group="copied", module=M + "transformer.moe.token_dispatcher",
        attribute="MoEAlltoAllTokenDispatcher.dispatch_preprocess", replacement=None,
        reason="copied and edited in megatron_ext.moe.token_dispatcher (the pad folded into the "
               "permute)",
        fingerprint="a4ba9a56bc9e95e0",
    ),
]  # fmt: skip

#: Every row, in the order applied.
TABLE: tuple[Patch, ...] = (*CPU_ROWS, *LOOP_ROWS, *OTHER_ROWS)


def rows(*groups: str, version: str | None = None) -> list[Patch]:
    """The rows of ``groups`` (a group ``"cpu"`` names every ``cpu.*`` row) that apply on the
    running Megatron (``version``: on that one), in table order."""
    unknown = [
        g for g in groups if not any(r.group.split(".")[0] == g or r.group == g for r in TABLE)
    ]
    assert not unknown, f"no compatibility rows in group(s) {unknown}"
    # An untested version takes the nearest tested version's rows.
    version = table_version(version)
    return [
        r
        for r in TABLE
        if (r.group in groups or r.group.split(".")[0] in groups) and r.applies_on(version)
    ]


def row(name: str, version: str | None = None) -> Patch:
    """The row of ``module.attribute`` ``name`` applied by a factory (not a :class:`HostTorch`
    row) on the running Megatron (``version``: on that one)."""
    version = table_version(version)
    found = [
        r
        for r in TABLE
        if r.name == name and not isinstance(r.replacement, HostTorch) and r.applies_on(version)
    ]
    assert len(found) == 1, f"{len(found)} compatibility rows for {name} on {version}"
    return found[0]
