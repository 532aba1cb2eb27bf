"""One frozen dataclass per megatron_ext feature; each field's docstring is its flag's help.

Flags are derived mechanically by Megatron's own ``ArgumentGroupFactory``: field ``pad_policy`` becomes
``--pad-policy`` with the docstring under the field as help, one argument group per feature (see
:mod:`megatron_ext.arguments`). Code below ``arguments.py`` receives these dataclasses, never ``args``.

Rules for a feature config:
- ``@feature_config("title")`` above ``@dataclass(frozen=True, kw_only=True)``.
- Types Megatron's factory understands: bool, int, float, str, Optional[x], list[x], Literal[...].
- ``__post_init__`` raises ``ValueError`` naming the flag (``--pad-policy``).
- Optional ``check_megatron_args(self, args)`` validates combinations with Megatron's own arguments and raises
  ``ValueError`` naming both flags; it runs at argument time.

This module must not use ``from __future__ import annotations``: the factory reads real type objects.
"""

import dataclasses
from typing import Callable, TypeVar

_C = TypeVar("_C")

#: Registered feature configs in declaration order, with the title of their argument group.
FEATURE_CONFIGS: dict[type, str] = {}


def feature_config(title: str) -> Callable[[type[_C]], type[_C]]:
    """Registers a frozen, keyword-only dataclass as a megatron_ext feature config.

    Args:
        title: Title of the argument group its flags appear under in ``--help``.
    """

    def register(cls: type[_C]) -> type[_C]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass to be a feature config")
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        if not (params.frozen and params.kw_only):
            raise TypeError(f"{cls.__name__} must be @dataclass(frozen=True, kw_only=True)")
        FEATURE_CONFIGS[cls] = title
        return cls

    return register


def flag(field_name: str) -> str:
    """Returns the command-line flag of a config field: ``pad_policy`` -> ``--pad-policy``."""
    return "--" + field_name.replace("_", "-")


# === data (issue 3) ===
import argparse  # section-local imports keep feature sections independent
import warnings
from dataclasses import dataclass, field
from typing import Literal

from megatron_ext.data.padding import derive_pad_multiple


@feature_config("data: self-token padding and document packing (issue 3)")
@dataclass(frozen=True, kw_only=True)
class PaddingConfig:
    """How packs are padded and how documents are packed (megatron_ext.data)."""

    pad_policy: Literal["self", "constant"] = "self"
    """Pad content: 'self' repeats the pack's own tokens (pads route like real text, no MoE hot
    spot); 'constant' writes --pad-constant-id. Pads are always loss-masked and after every real
    token."""

    pad_constant_id: int = 0
    """Token id of constant pads (--pad-policy constant, multimodal packs, empty packs)."""

    pad_to_seq_len: bool = False
    """Pad every pack to exactly --seq-length (static shapes: no recompiles)."""

    pad_to_multiple_of: int | None = None
    """Pad packs to a multiple of this; default derived from the run: 2*CP with context
    parallelism, TP with sequence parallelism, 16 under fp8 (their lcm)."""

    pack_documents: bool = False
    """Train on megatron_ext's PackedDataset (whole documents packed, document boundaries kept)
    instead of the self-padded GPTDataset."""

    packing_algorithm: Literal["sequential", "best_fit"] = "best_fit"
    """'sequential' keeps the shuffled order (next-fit); 'best_fit' packs longest-first into the
    tightest pack within --packing-window documents (fewer pads)."""

    packing_window: int = 1000
    """Documents considered together by --packing-algorithm best_fit."""

    pack_overlong_policy: Literal["split", "truncate", "drop"] = "split"
    """Documents longer than --seq-length: split into pieces, keep the head, or drop them."""

    pack_loss_mask_suffix: str | None = None
    """If set, every --data-path prefix P has a per-token loss-mask sidecar IndexedDataset at
    P + suffix (1 = train on this token, 0 = prompt), e.g. '_loss_mask'."""

    multimodal_placeholder_ids: list[int] = field(default_factory=list)
    """Placeholder token ids (e.g. image tokens); a pack containing one pads with
    --pad-constant-id so a placeholder never leaves its item."""

    def __post_init__(self) -> None:
        if self.pad_policy not in ("self", "constant"):
            raise ValueError(f"--pad-policy must be 'self' or 'constant', got {self.pad_policy!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"--pad-to-multiple-of must be >= 1, got {self.pad_to_multiple_of}")
        if self.packing_algorithm not in ("sequential", "best_fit"):
            raise ValueError(
                "--packing-algorithm must be 'sequential' or 'best_fit', "
                f"got {self.packing_algorithm!r}"
            )
        if self.packing_window < 1:
            raise ValueError(f"--packing-window must be >= 1, got {self.packing_window}")
        if self.pack_overlong_policy not in ("split", "truncate", "drop"):
            raise ValueError(
                "--pack-overlong-policy must be 'split', 'truncate' or 'drop', "
                f"got {self.pack_overlong_policy!r}"
            )
        if self.pad_constant_id < 0:
            raise ValueError(f"--pad-constant-id must be >= 0, got {self.pad_constant_id}")
        if self.pad_constant_id in self.multimodal_placeholder_ids:
            raise ValueError(
                f"--pad-constant-id {self.pad_constant_id} is one of "
                "--multimodal-placeholder-ids: pads would look like image tokens"
            )
        if self.pack_loss_mask_suffix == "":
            raise ValueError("--pack-loss-mask-suffix must not be empty")

    def pad_multiple(
        self,
        *,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        fp8: bool = False,
    ) -> int:
        """The pack-length multiple for this run: the user's value, else the derived one.

        Raises:
            ValueError: The user's --pad-to-multiple-of is not a multiple of what the run needs.
        """
        required = derive_pad_multiple(
            context_parallel_size=context_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            fp8=fp8,
        )
        if self.pad_to_multiple_of is None:
            return required
        if self.pad_to_multiple_of % required:
            why = []
            if context_parallel_size > 1:
                why.append(f"--context-parallel-size {context_parallel_size} (needs 2*CP)")
            if sequence_parallel and tensor_parallel_size > 1:
                why.append(
                    f"--sequence-parallel with --tensor-model-parallel-size {tensor_parallel_size}"
                )
            if fp8:
                why.append("--fp8-format (needs 16)")
            raise ValueError(
                f"--pad-to-multiple-of {self.pad_to_multiple_of} conflicts with "
                f"{', '.join(why)}: it must be a multiple of {required}"
            )
        return self.pad_to_multiple_of

    def check_megatron_args(self, args: argparse.Namespace) -> None:
        """Checks the padding multiple against Megatron's CP / TP+SP / fp8 and --seq-length."""
        multiple = self.pad_multiple(
            context_parallel_size=getattr(args, "context_parallel_size", 1) or 1,
            tensor_parallel_size=getattr(args, "tensor_model_parallel_size", 1) or 1,
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
            fp8=getattr(args, "fp8", None) is not None,
        )
        if not self.pack_documents:
            unused = [
                flag(name)
                for name in ("packing_algorithm", "packing_window", "pack_overlong_policy",
                             "pack_loss_mask_suffix")
                if getattr(self, name) != PaddingConfig.__dataclass_fields__[name].default
            ]
            if unused:
                warnings.warn(f"{unused} have no effect without --pack-documents", stacklevel=2)
        seq_length = getattr(args, "seq_length", None)
        if seq_length is not None and seq_length % multiple:
            raise ValueError(
                f"--seq-length {seq_length} is not a multiple of the pack-length multiple "
                f"{multiple} (--pad-to-multiple-of / derived from CP, TP+SP, fp8)"
            )


# === moe (issue 4) ===
import argparse as _moe_argparse  # section-local imports keep feature sections independent
import warnings as _moe_warnings
from dataclasses import dataclass as _moe_dataclass
from typing import Literal as _MoeLiteral

from megatron_ext.moe.alignment import align_size_for as _align_size_for
from megatron_ext.moe.alignment import precision_of as _precision_of


@feature_config("moe: grouped-GEMM alignment after dispatch and expert load metrics (issue 4)")
@_moe_dataclass(frozen=True, kw_only=True)
class MoEAlignmentConfig:
    """Sync-free fp8/mxfp8/nvfp4 group alignment in the token dispatcher (megatron_ext.moe)."""

    moe_dispatch_align: bool = False
    """Align every local expert's token group after dispatch to the multiple its grouped GEMM
    needs (fp8 16, mxfp8 32, nvfp4 128; bf16/fp16 none: identity, no copy), with zero pad rows,
    no extra host sync and no extra all-to-all traffic. Replaces
    --moe-router-padding-for-quantization (refused together)."""

    moe_dispatch_align_size: int | None = None
    """Override the alignment multiple under fp8/fp4 (e.g. 256 for CUTLASS grouped kernels); it
    must be a multiple of the recipe's own (fp8 16, mxfp8 32, nvfp4 128). Ignored (with a
    warning) under bf16/fp16. Default: derived from --fp8-recipe / --fp4-recipe."""

    moe_dispatch_align_buffer: _MoeLiteral["host_counts", "static_bound"] = "host_counts"
    """Size of the aligned buffer: 'host_counts' is exact, from the token counts the dispatcher
    already copied to the host; 'static_bound' reads nothing (N + E*(A-1) rows, the last expert
    absorbs the slack), for paths that keep counts on the device."""

    moe_expert_load_metrics: bool = False
    """Track per-layer token counts per expert and per EP rank (with and without pad tokens),
    max/mean and max_vio = (max - mean) / mean, on device; reduced only when logged. Counts one
    pass per training micro-batch (not recomputes, not evaluation). Needs --num-experts."""

    def __post_init__(self) -> None:
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
        """The multiple groups are padded to for these precision settings (0: no alignment)."""
        if not self.moe_dispatch_align:
            return 0
        precision = _precision_of(fp8, fp8_recipe, fp4, fp4_recipe)
        return _align_size_for(precision, self.moe_dispatch_align_size)

    def check_megatron_args(self, args: _moe_argparse.Namespace) -> None:
        """Refuses combinations with Megatron's flags that would double-pad, cannot align or crash.

        Raises:
            ValueError: Naming both flags of the refused combination.
        """
        if self.moe_expert_load_metrics and not getattr(args, "num_experts", None):
            raise ValueError(
                "--moe-expert-load-metrics needs an MoE model: set --num-experts (a dense model "
                "has no routing to count)"
            )
        if not self.moe_dispatch_align:
            return
        if getattr(args, "moe_router_padding_for_quantization", False):
            raise ValueError(
                "--moe-dispatch-align and --moe-router-padding-for-quantization both pad expert "
                "groups; use only --moe-dispatch-align (no extra all-to-all rows, no host sync)"
            )
        if getattr(args, "moe_pad_expert_input_to_capacity", False):
            raise ValueError(
                "--moe-dispatch-align cannot be combined with --moe-pad-expert-input-to-capacity: "
                "capacity padding already fixes every group's size; choose a capacity whose "
                "per-expert rows are a multiple of the alignment instead"
            )
        precision = {
            "fp8": getattr(args, "fp8", None),
            "fp8_recipe": getattr(args, "fp8_recipe", None),
            "fp4": getattr(args, "fp4", None),
            "fp4_recipe": getattr(args, "fp4_recipe", None),
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
        dispatcher = getattr(args, "moe_token_dispatcher_type", "allgather")
        if dispatcher == "flex" and override is not None and quantized:
            derived = _moe_required_align(args)
            if self.align_size(**precision) != derived:
                raise ValueError(
                    f"--moe-dispatch-align-size {override} with "
                    "--moe-token-dispatcher-type flex under fp8/fp4: HybridEP re-derives its "
                    f"pad_multiple ({derived}) from the recipe, so an override cannot be honoured"
                )
        if not quantized:
            # A setting with no effect on the current path warns once (STYLE).
            if override:
                _moe_warn_once(
                    f"--moe-dispatch-align-size {override} pads bf16/fp16 expert groups, which "
                    "need no padding (it only costs time)"
                )
            else:
                _moe_warn_once(
                    "--moe-dispatch-align has no effect without --fp8-format / --fp4-format: "
                    "bf16/fp16 grouped GEMMs need no alignment (Megatron's path runs untouched)"
                )


def _moe_recipe_name(precision: dict) -> str:
    recipe = precision["fp8_recipe"] if precision["fp8"] else precision["fp4_recipe"]
    return str(getattr(recipe, "value", recipe))


def _moe_required_align(args: _moe_argparse.Namespace) -> int:
    """The group multiple Megatron's own ``get_align_size_for_quantization`` asks of these args."""
    from megatron.core.enums import Fp4Recipe, Fp8Recipe
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    fp8_recipe = getattr(args, "fp8_recipe", None) or "delayed"
    fp4_recipe = getattr(args, "fp4_recipe", None) or "nvfp4"
    view = _moe_argparse.Namespace(
        use_transformer_engine_op_fuser=getattr(args, "use_transformer_engine_op_fuser", False),
        fp8=getattr(args, "fp8", None),
        fp8_recipe=Fp8Recipe(getattr(fp8_recipe, "value", fp8_recipe)),
        fp4=getattr(args, "fp4", None),
        fp4_recipe=Fp4Recipe(getattr(fp4_recipe, "value", fp4_recipe)),
    )
    return get_align_size_for_quantization(view)


_MOE_WARNED: set[str] = set()


def _moe_warn_once(message: str) -> None:
    """Warns the first time ``message`` is seen in this process (STYLE: warn once)."""
    if message not in _MOE_WARNED:
        _MOE_WARNED.add(message)
        _moe_warnings.warn(message, stacklevel=3)


# === replay (issue 5) ===
import argparse as _argparse  # section-local imports keep feature sections independent
import os as _os
import warnings as _replay_warnings
from dataclasses import dataclass as _dataclass
from typing import Literal as _Literal

from megatron_ext.replay.unsupported import check_replay_supported


@feature_config("replay: route record/replay bound to Megatron's RouterReplay (issue 5)")
@_dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """Route replay (R3): train on the experts the rollout engine chose (megatron_ext.replay)."""

    route_replay_mode: _Literal["off", "record", "replay"] = "off"
    """'replay' installs each pack's recorded routes into the MoE routers (every MoE layer's
    top-k equals the recorded one); 'record' captures the routes the forward chose and writes
    them to --route-record-path; 'off' routes natively."""

    route_data_suffix: str | None = None
    """Route sidecars: every --data-path prefix P has a route IndexedDataset at P + suffix
    (tools/convert_routes.py output, e.g. '_routes'), aligned document by document and token by
    token with P; the packer gathers, packs and pads it exactly as the tokens."""

    route_record_path: str | None = None
    """Output prefix of the route sidecar written by --route-replay-mode record."""

    replay_missing_route_policy: _Literal["native", "balanced"] = "native"
    """Tokens with no recorded route (vLLM's last token, tool tokens, constant-id pads):
    'native' lets the router decide them; 'balanced' fills a distinct top-k spread evenly over
    EP ranks for every EP size dividing the expert count."""

    def __post_init__(self) -> None:
        if self.route_replay_mode not in ("off", "record", "replay"):
            raise ValueError(
                "--route-replay-mode must be 'off', 'record' or 'replay', "
                f"got {self.route_replay_mode!r}"
            )
        if self.replay_missing_route_policy not in ("native", "balanced"):
            raise ValueError(
                "--replay-missing-route-policy must be 'native' or 'balanced', "
                f"got {self.replay_missing_route_policy!r}"
            )
        if self.route_replay_mode == "replay" and not self.route_data_suffix:
            raise ValueError("--route-replay-mode replay needs --route-data-suffix")
        if self.route_replay_mode == "record" and not self.route_record_path:
            raise ValueError("--route-replay-mode record needs --route-record-path")
        unused = {
            "off": ("route_data_suffix", "route_record_path"),
            "record": ("route_data_suffix",),
            "replay": ("route_record_path",),
        }[self.route_replay_mode]
        for name in (n for n in unused if getattr(self, n) is not None):
            _replay_warnings.warn(
                f"{flag(name)} has no effect with --route-replay-mode {self.route_replay_mode}",
                stacklevel=2,
            )
        if self.route_replay_mode == "record":
            parent = _os.path.dirname(_os.path.abspath(self.route_record_path))
            if not _os.path.isdir(parent):
                raise ValueError(
                    f"--route-record-path: directory {parent} does not exist"
                )

    def check_megatron_args(self, args: _argparse.Namespace) -> None:
        """Refuses every Megatron setting under which 0.19.2 would silently skip replay."""
        if self.route_replay_mode == "off":
            return
        check_replay_supported(args, f"--route-replay-mode {self.route_replay_mode}")
        if self.route_replay_mode == "replay":
            if not getattr(args, "pack_documents", False):
                raise ValueError(
                    "--route-replay-mode replay reads route sidecars through the packed dataset: "
                    "add --pack-documents"
                )
            paths = [getattr(args, name, None) or [] for name in _DATA_PATH_ARGS]
            for prefix in (p for group in paths for p in group if not _is_number(p)):
                for ext in (".bin", ".idx"):
                    path = prefix + self.route_data_suffix + ext
                    if not _os.path.isfile(path):
                        raise ValueError(
                            f"--route-data-suffix {self.route_data_suffix}: route file {path} "
                            f"for --data-path prefix {prefix} does not exist"
                        )


_DATA_PATH_ARGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

# === entry points (issue 6) ===


@feature_config("entry: megatron_ext.pretrain_gpt")
@_dataclass(frozen=True, kw_only=True)
class EntryConfig:
    """Options of ``python -m megatron_ext.pretrain_gpt`` itself."""

    dry_run: bool = False
    """Validate every argument (Megatron's and megatron_ext's) for the world size of the launch
    (WORLD_SIZE), print the resolved configuration and exit, without initialising distributed
    training or touching a GPU (data files are only checked for existence)."""

    def check_megatron_args(self, args: _argparse.Namespace) -> None:
        """Refuses what Megatron's data loader cannot run with megatron_ext's datasets."""
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
            per_split = [getattr(args, n, None) for n in ("train_data_path", "valid_data_path",
                                                         "test_data_path")]
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
