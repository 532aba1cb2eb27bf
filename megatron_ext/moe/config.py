"""Flags of the MoE alignment feature: :class:`MoEAlignmentConfig`."""

import argparse as _moe_argparse
import warnings as _moe_warnings
from dataclasses import dataclass as _moe_dataclass
from typing import Literal as _MoeLiteral

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import feature_config, flag_value


@feature_config("moe: grouped-GEMM alignment after dispatch and expert load metrics")
@_moe_dataclass(frozen=True, kw_only=True)
class MoEAlignmentConfig:
    """Sync-free fp8/mxfp8/nvfp4 group alignment in the token dispatcher (megatron_ext.moe)."""

    moe_dispatch_align: bool = False
    """Align every local expert's token group after dispatch to the multiple its grouped GEMM
    needs (fp8 16, mxfp8 32, nvfp4 128; bf16/fp16 none: identity, no copy), with zero pad rows,
    no extra host sync and no extra all-to-all traffic. Replaces
    --moe-router-padding-for-quantization (refused together)."""

    moe_dispatch_align_size: int | None = None
    """With --moe-dispatch-align: override the alignment multiple under fp8/fp4 (e.g. 256 for
    CUTLASS grouped kernels); it must be a multiple of the recipe's own (fp8 16, mxfp8 32, nvfp4
    128). Ignored (with a warning) under bf16/fp16. Default: derived from --fp8-recipe /
    --fp4-recipe."""

    moe_dispatch_align_buffer: _MoeLiteral["host_counts", "static_bound"] = "host_counts"
    """Size of the aligned buffer: 'host_counts' is exact, from the token counts the dispatcher
    already copied to the host; 'static_bound' reads nothing (N + E*(A-1) rows, the last expert
    absorbs the slack), for paths that keep counts on the device."""

    moe_expert_load_metrics: bool = False
    """Track per-layer token counts per expert and per EP rank (with and without pad tokens),
    max/mean and max_vio = (max - mean) / mean, on device; reduced only when logged. Counts one
    pass per training micro-batch (not recomputes, not evaluation). Needs --num-experts."""

    moe_expert_load_log: str | None = None
    """With --moe-expert-load-metrics: also append every logged summary (per layer: tokens per
    expert with and without pads, per-EP-rank and per-expert max_vio) as one JSON line to this
    file (rank 0; under pipeline parallelism each stage's first rank, one line per stage with its
    ``pipeline_stage``), for analysis beside TensorBoard/W&B; with --route-replay-check, also
    its counts (lines with a ``replay_check`` key)."""

    def __post_init__(self) -> None:
        if self.moe_expert_load_log and not self.moe_expert_load_metrics:
            raise ValueError("--moe-expert-load-log needs --moe-expert-load-metrics")
        if self.moe_dispatch_align_size is not None and not self.moe_dispatch_align:
            raise ValueError(
                f"--moe-dispatch-align-size {self.moe_dispatch_align_size} needs "
                "--moe-dispatch-align (without it no expert group is aligned)"
            )
        if self.moe_dispatch_align_size is not None and self.moe_dispatch_align_size < 0:
            raise ValueError(
                f"--moe-dispatch-align-size must be >= 0, got {self.moe_dispatch_align_size}"
            )
        if self.moe_dispatch_align_buffer not in ("host_counts", "static_bound"):
            raise ValueError(
                "--moe-dispatch-align-buffer must be 'host_counts' or 'static_bound', "
                f"got {self.moe_dispatch_align_buffer!r}"
            )

    def align_size(
        self, *, fp8: object, fp8_recipe: object, fp4: object, fp4_recipe: object
    ) -> int:
        """The multiple groups are padded to for these precision settings (0: no alignment):
        :func:`align_size_for_config` of them."""
        precision = _moe_argparse.Namespace(
            fp8=fp8, fp8_recipe=fp8_recipe, fp4=fp4, fp4_recipe=fp4_recipe
        )
        return align_size_for_config(precision, self)

    def check_megatron_args(self, args: _moe_argparse.Namespace) -> None:
        """Refuses (naming both flags) combinations with Megatron's flags that would double-pad,
        cannot align or crash."""
        view = MegatronView.from_args(args)
        if self.moe_expert_load_metrics and not view.num_experts:
            raise ValueError(
                "--moe-expert-load-metrics needs an MoE model: set --num-experts (a dense model "
                "has no routing to count)"
            )
        if self.moe_expert_load_log:
            check_load_log(self.moe_expert_load_log)
        if not self.moe_dispatch_align:
            return
        quantized = self.refuse_unalignable(args)
        override = self.moe_dispatch_align_size
        # A --cpu rehearsal (megatron_ext.training.cpu_rehearsal) took fp8/fp4 out of the
        # arguments after checking them; its expert groups are still aligned. Not Megatron's:
        # megatron_ext's own mark on the arguments, absent unless a rehearsal set it.
        if not quantized and not getattr(args, "rehearsed_precision", None):
            # A setting with no effect on the current path warns once.
            if override:
                _moe_warn_once(
                    f"--moe-dispatch-align-size {override} has no effect without --fp8-format / "
                    "--fp4-format: bf16/fp16 expert groups are not padded (Megatron's path runs "
                    "untouched)"
                )
            else:
                _moe_warn_once(
                    "--moe-dispatch-align has no effect without --fp8-format / --fp4-format: "
                    "bf16/fp16 grouped GEMMs need no alignment (Megatron's path runs untouched)"
                )

    def refuse_unalignable(self, args: _moe_argparse.Namespace) -> bool:
        """The refusals of :meth:`check_megatron_args` for an aligned run, without its warnings, of
        Megatron's arguments or a layer's ``TransformerConfig``; returns whether it is fp8/fp4."""
        # The same names on both: AlignedMoELayer refuses at construction, for a model built from
        # a spec in a user's own script, what pretrain_gpt refuses at argument time.
        view = MegatronView.from_args(args)
        if view.moe_router_padding_for_quantization:
            raise ValueError(
                "--moe-dispatch-align and --moe-router-padding-for-quantization both pad expert "
                "groups; use only --moe-dispatch-align (no extra all-to-all rows, no host sync)"
            )
        if view.moe_pad_expert_input_to_capacity:
            raise ValueError(
                "--moe-dispatch-align cannot be combined with --moe-pad-expert-input-to-capacity: "
                "capacity padding already fixes every group's size; choose a capacity whose "
                "per-expert rows are a multiple of the alignment instead"
            )
        precision = {
            "fp8": view.fp8,
            "fp8_recipe": view.fp8_recipe,
            "fp4": view.fp4,
            "fp4_recipe": view.fp4_recipe,
        }
        quantized = bool(precision["fp8"] or precision["fp4"])
        override = self.moe_dispatch_align_size
        if quantized and override is not None:
            required = _moe_required_align(args)
            if override <= 1 or override % required:
                flag = "--fp8-recipe" if precision["fp8"] else "--fp4-recipe"
                raise ValueError(
                    f"--moe-dispatch-align-size {override} under {flag} "
                    f"{_moe_recipe_name(precision)}: the quantized grouped GEMM needs every "
                    f"group to be a multiple of {required} (Megatron's "
                    "get_align_size_for_quantization); use a multiple of it or drop the override"
                )
        if view.moe_token_dispatcher_type == "flex" and override is not None and quantized:
            derived = _moe_required_align(args)
            if self.align_size(**precision) != derived:
                raise ValueError(
                    f"--moe-dispatch-align-size {override} with "
                    "--moe-token-dispatcher-type flex under fp8/fp4: HybridEP re-derives its "
                    f"pad_multiple ({derived}) from the recipe, so an override cannot be honoured"
                )
        return quantized


def _moe_recipe_name(precision: dict) -> str:
    recipe = precision["fp8_recipe"] if precision["fp8"] else precision["fp4_recipe"]
    return str(getattr(recipe, "value", recipe))


def _moe_required_align(args: _moe_argparse.Namespace) -> int:
    """The group multiple Megatron's own ``get_align_size_for_quantization`` asks of these args."""
    from megatron_ext.data.quantization_align import megatron_align_size

    return megatron_align_size(args)


_MOE_WARNED: set[str] = set()


def _moe_warn_once(message: str) -> None:
    """Warns the first time ``message`` is seen in this process."""
    if message not in _MOE_WARNED:
        _MOE_WARNED.add(message)
        _moe_warnings.warn(message, stacklevel=3)


@feature_config("moe: pad tokens in the MoE layer, skipped or dropped first")
@_moe_dataclass(frozen=True, kw_only=True)
class MoEPadRoutingConfig:
    """What pad tokens cost in the MoE layer (megatron_ext.moe.pad_routing)."""

    moe_pad_routing: _MoeLiteral["dispatch", "skip", "auto"] = "auto"
    """Pad tokens (padding_mask) in the MoE layer. 'skip': after routing (and replay) pads' rows
    of the routing map are cleared and their probabilities zeroed, so pads send no all-to-all row
    and reach no expert GEMM (their MoE output is the shared experts' or zero); real tokens are
    unchanged. 'dispatch': pads are routed like text (Megatron's behaviour; self-padding keeps them
    spread). 'auto': skip wherever nothing needs the pads' rows (dropless alltoall/allgather
    dispatch, no capacity padding, no CUDA graphs over the MoE layer, no router padding for
    quantization), else dispatch. Under --moe-expert-capacity-factor pads are always dropped
    before real tokens."""

    def __post_init__(self) -> None:
        from megatron_ext.moe.pad_routing import PAD_ROUTING_MODES

        if self.moe_pad_routing not in PAD_ROUTING_MODES:
            raise ValueError(
                f"--moe-pad-routing must be one of {list(PAD_ROUTING_MODES)}, "
                f"got {self.moe_pad_routing!r}"
            )

    def resolve(self, args: _moe_argparse.Namespace) -> tuple[str, str]:
        """``(mode, reason)`` for these Megatron arguments: 'skip' or 'dispatch' (ValueError for
        ``skip`` with a configuration that needs the pads' rows, naming both flags)."""
        from megatron_ext.moe.pad_routing import resolve_pad_routing

        view = MegatronView.from_args(args)
        cpu = bool(flag_value(args, "cpu"))
        return resolve_pad_routing(
            self.moe_pad_routing,
            capacity_factor=view.moe_expert_capacity_factor,
            pad_to_capacity=bool(view.moe_pad_expert_input_to_capacity),
            cuda_graph_over_moe=_cuda_graph_over_moe(view),
            dispatcher=view.moe_token_dispatcher_type,
            router_padding=bool(view.moe_router_padding_for_quantization),
            gloo_expert_tp=cpu and _expert_tp(view) > 1,
        )

    def check_megatron_args(self, args: _moe_argparse.Namespace) -> None:
        """Refuses ``skip`` where static shapes or another padding need the pads' rows."""
        if MegatronView.from_args(args).num_experts:
            self.resolve(args)


def _expert_tp(view: MegatronView) -> int:
    """Megatron's expert tensor-parallel size (it defaults to the tensor-parallel size)."""
    etp = view.expert_tensor_parallel_size
    return int(etp if etp is not None else view.tensor_model_parallel_size or 1)


def _cuda_graph_over_moe(view: MegatronView) -> bool:
    """Whether Megatron's CUDA graphs capture the MoE layer or part of it (router, preprocess)."""
    impl = view.cuda_graph_impl
    if impl in (None, "none"):
        return False
    modules = view.cuda_graph_modules or []
    names = {str(getattr(m, "name", m)) for m in modules}
    return not names or bool(names & {"moe", "moe_router", "moe_preprocess"})


def check_load_log(path: str) -> None:
    """Refuses a ``--moe-expert-load-log`` that appending would damage: a directory, a place
    that cannot be written, or an existing file that is not such a log (a data file, say)."""
    # A missing directory is created when the first line is written.
    import json
    import os

    from megatron_ext.common.safe_files import check_writable_dir

    flag = "--moe-expert-load-log"
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory")
    check_writable_dir(path, flag)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        record = json.loads(first)
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict) or "iteration" not in record:  # every log line has one
        raise ValueError(
            f"{flag} {path} exists and is not an expert-load log (its first line is not one of "
            "its JSON records); appending would change that file: name a new file"
        )


def align_size_for_config(config: object, alignment: "MoEAlignmentConfig") -> int:
    """The group multiple for a Megatron config (0: no alignment): the one place it is decided,
    from Megatron's ``get_align_size_for_quantization`` (fp8 16, mxfp8 32, fp4 128, 256 under
    ``use_transformer_engine_op_fuser``)."""
    # Ours, where Megatron has no rule: without fp8/fp4 it is 0, though Megatron's function says
    # 256 under the op fuser even for bf16 (Megatron only uses it under fp8/fp4: TEGroupedMLP
    # builds and calls its Fp8Padding only then), and bf16 must stay Megatron's path, untouched.
    if not alignment.moe_dispatch_align or not (config.fp8 or config.fp4):
        return 0
    override = alignment.moe_dispatch_align_size
    # Ours too: an override wins (check_megatron_args keeps it a multiple of Megatron's value).
    if override is not None:
        return override if override > 1 else 0  # 0 or 1 disables
    from megatron_ext.data.quantization_align import megatron_align_size

    return megatron_align_size(config)
