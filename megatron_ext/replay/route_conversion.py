"""Rollout records -> repaired route documents: the conversion ``convert-routes`` and
``ingest-rollouts`` share (pure numpy, never imports megatron). The tools differ only in where the
token ids come from (``--tokens-prefix``, or the records) and what they write beside the routes::

    converter = RouteConverter.from_args(args)           # refuses flags that disagree
    for index, doc in enumerate(converter.documents(args.input, args.format)):
        routes_TLK = converter.convert(doc, index, num_tokens)   # [T, L, K] route dtype
    converter.check_fractions()                          # the limits, after the last record

Legend: T tokens of a document, L MoE layers, K top-k.
"""

import argparse
import os
from collections.abc import Iterator

import numpy as np

from megatron_ext.replay.moe_layer_map import (
    VLLM_MOE_ROWS,
    MoeLayerMap,
    parse_layer_ids,
    read_model_config,
    select_moe_rows,
)
from megatron_ext.replay.rollout_routes import RepairCounts, RolloutDocument, repair_document
from megatron_ext.replay.route_records import T_MINUS_ONE_FORMATS, read_documents
from megatron_ext.replay.routes import route_dtype

#: Defaults of the fraction limits (docs/replay.md says why).
MAX_REJECTED_FRACTION = 0.01
MAX_MISSING_FRACTION = 0.05


def add_route_flags(p: argparse.ArgumentParser) -> None:
    """The model and conversion flags both tools take."""
    p.add_argument("--num-layers", type=int, help="MoE layers L (MTP excluded); from the layer map")
    p.add_argument("--topk", type=int, help="experts per token K (or --model-config's)")
    p.add_argument("--num-experts", type=int, help="routed experts E (or --model-config's)")
    p.add_argument(
        "--moe-layer-ids",
        help="0-based decoder layers that are MoE, e.g. 3-60 or 1,3,5 (needs --num-decoder-layers "
        "to drop dense rows from a per-decoder-layer dump)",
    )
    p.add_argument("--num-decoder-layers", type=int, help="decoder layers N of the model")
    p.add_argument(
        "--model-config",
        help="the model's Hugging Face config.json: decoder layers, MoE layers "
        "(first_k_dense_replace, moe_layer_freq, mlp_only_layers, decoder_sparse_step), K, E",
    )
    p.add_argument(
        "--vllm-moe-rows",
        default="auto",
        choices=VLLM_MOE_ROWS,
        help="how a vLLM dump of N decoder-layer rows orders them: 'decoder' (vLLM 0.34: row i is "
        "decoder layer i, dense rows zero), 'first' (vLLM 0.21: the MoE layers' rows first, in "
        "order, then zero rows; its _count_moe_layers misses first_k_dense_replace), 'auto' "
        "(default: from the response's system_fingerprint 'vllm-0.21...' or vLLM 0.21's split "
        "prompt_routed_experts form; never guessed from zero rows)",
    )
    p.add_argument(
        "--routed-experts-start",
        type=int,
        default=0,
        help="the requests' vLLM routed_experts_prompt_start / SGLang routed_experts_start_len "
        "(a record's own key of that name wins)",
    )
    p.add_argument(
        "--missing-route-policy",
        default="native",
        choices=["native", "balanced"],
        help="rows with no route: keep missing (router decides) or fill balanced",
    )
    p.add_argument(
        "--reject-invalid-rows",
        action="store_true",
        help="make invalid rows missing (counted) instead of failing",
    )
    p.add_argument(
        "--max-rejected-fraction",
        type=float,
        default=MAX_REJECTED_FRACTION,
        help="refuse the output if more of its (token, layer) rows than this were rejected "
        f"(default {MAX_REJECTED_FRACTION})",
    )
    p.add_argument(
        "--max-missing-fraction",
        type=float,
        default=MAX_MISSING_FRACTION,
        help="refuse the output if more of its (token, layer) rows than this have no engine "
        "route (before start offsets, rejected, missing in the input; the last token's rows, "
        f"never routed by an engine, do not count), missing or filled (default {MAX_MISSING_FRACTION})",
    )


def layer_map_from_args(args: argparse.Namespace) -> MoeLayerMap | None:
    """The layer map from --model-config / --moe-layer-ids; fills L, K, E on ``args`` from it."""
    layer_map = None
    if args.model_config:
        layer_map = read_model_config(args.model_config)
    if args.moe_layer_ids:
        ids = parse_layer_ids(args.moe_layer_ids)
        if layer_map is not None and ids != layer_map.moe_layer_ids:
            raise ValueError(
                f"--moe-layer-ids {args.moe_layer_ids} disagrees with --model-config's MoE "
                f"layers {list(layer_map.moe_layer_ids)}"
            )
        layer_map = layer_map or MoeLayerMap(args.num_decoder_layers, ids)
    if args.num_decoder_layers is not None:
        if layer_map is None:
            raise ValueError("--num-decoder-layers needs --moe-layer-ids")
        if args.num_decoder_layers != layer_map.num_decoder_layers:
            raise ValueError(
                f"--num-decoder-layers {args.num_decoder_layers} disagrees with --model-config's "
                f"num_hidden_layers {layer_map.num_decoder_layers}"
            )
    if layer_map is not None and layer_map.num_decoder_layers is not None:
        if layer_map.moe_layer_ids[-1] >= layer_map.num_decoder_layers:
            raise ValueError(
                f"--moe-layer-ids names layer {layer_map.moe_layer_ids[-1]} of a model with "
                f"{layer_map.num_decoder_layers} decoder layers"
            )
    for flag, given, value in (
        (
            "--num-layers",
            args.num_layers,
            None if layer_map is None else len(layer_map.moe_layer_ids),
        ),
        ("--topk", args.topk, None if layer_map is None else layer_map.topk),
        ("--num-experts", args.num_experts, None if layer_map is None else layer_map.num_experts),
    ):
        attr = flag[2:].replace("-", "_")
        if given is not None and value is not None and given != value:
            raise ValueError(f"{flag} {given} disagrees with the layer map's {value}")
        if given is None and value is None:
            raise ValueError(f"{flag} is required (or give --model-config)")
        setattr(args, attr, given if given is not None else value)
    return layer_map


def check_route_args(args: argparse.Namespace) -> MoeLayerMap | None:
    """Every check of :func:`add_route_flags`' flags and of ``--input``; returns the layer map."""
    layer_map = layer_map_from_args(args)
    if args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    route_dtype(args.num_experts, args.topk)  # rejects impossible E / K early
    if args.routed_experts_start < 0:
        raise ValueError(f"--routed-experts-start must be >= 0, got {args.routed_experts_start}")
    for flag, value in (
        ("--max-rejected-fraction", args.max_rejected_fraction),
        ("--max-missing-fraction", args.max_missing_fraction),
    ):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{flag} must be in [0, 1], got {value}")
    if args.vllm_moe_rows != "auto" and args.format != "vllm":
        raise ValueError(f"--vllm-moe-rows {args.vllm_moe_rows} applies to --format vllm only")
    if args.vllm_moe_rows == "first" and (
        layer_map is None or layer_map.num_decoder_layers is None
    ):
        raise ValueError(
            "--vllm-moe-rows first needs the model's decoder layers: give --model-config (or "
            "--moe-layer-ids with --num-decoder-layers)"
        )
    for path in args.input:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path} does not exist")
    return layer_map


class RouteConverter:
    """One record's routes at a time -> validated ``[T, L, K]`` documents, with the totals the
    limits and the summary line read."""

    def __init__(self, args: argparse.Namespace, layer_map: MoeLayerMap | None) -> None:
        self.args = args
        self.layer_map = layer_map
        self.totals = RepairCounts()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RouteConverter":
        """Checks the flags (:func:`check_route_args`) and builds the converter."""
        return cls(args, check_route_args(args))

    @property
    def moe_layer_ids(self) -> tuple[int, ...] | None:
        """The decoder layers of the L rows (the header's ``moe_layer_ids``), if known."""
        return None if self.layer_map is None else self.layer_map.moe_layer_ids

    def documents(self, paths: list[str], fmt: str) -> Iterator[RolloutDocument]:
        """The records' documents, in order, read one record at a time."""
        wire_layers = self.args.num_layers
        if self.layer_map is not None and self.layer_map.num_decoder_layers is not None:
            wire_layers = self.layer_map.num_decoder_layers  # shapeless payloads: every layer
        return read_documents(
            paths,
            fmt,
            wire_layers=wire_layers,
            topk=self.args.topk,
            start=self.args.routed_experts_start,
            vllm_moe_rows=self.args.vllm_moe_rows,
        )

    def convert(self, doc: RolloutDocument, index: int, num_tokens: int | None) -> np.ndarray:
        """Document ``index``'s route buffer; ``num_tokens``: its T (None: from the rows)."""
        args = self.args
        if num_tokens is None and args.format in T_MINUS_ONE_FORMATS:
            # These engines return T - 1 rows for T tokens: taking the rows as complete would
            # silently make the document's routes one row short of its tokens.
            raise ValueError(
                f"{doc.name}: a --format {args.format} record holds T - 1 rows for T tokens; give "
                "its num_tokens or token_ids, or pass --tokens-prefix"
            )
        rows = doc.rows_TLK
        if self.layer_map is not None and rows.ndim == 3 and rows.shape != (0, 0, 0):  # [] no N
            rows = select_moe_rows(rows, self.layer_map, doc.name, doc.moe_rows_first)
        routes, counts = repair_document(
            rows,
            num_tokens,
            num_layers=args.num_layers,
            topk=args.topk,
            num_experts=args.num_experts,
            policy=args.missing_route_policy,
            reject_invalid=args.reject_invalid_rows,
            name=doc.name,
            seed=index,
            start=doc.start,
            exact=doc.exact,
        )
        self.totals.add(counts)
        return routes

    def check_fractions(self) -> None:
        """Refuses an output that would mostly replay nothing (nothing is written)."""
        args, totals = self.args, self.totals
        rows = max(totals.layer_rows, 1)
        if totals.rejected_rows / rows > args.max_rejected_fraction:
            raise ValueError(
                f"{totals.rejected_rows} of {totals.layer_rows} (token, layer) rows "
                f"({totals.rejected_rows / rows:.2%}) hold invalid expert ids and were rejected, "
                f"above --max-rejected-fraction {args.max_rejected_fraction}: wrong --num-experts, "
                "layer map or dump; nothing written"
            )
        if totals.unrouted_rows / rows > args.max_missing_fraction:
            raise ValueError(
                f"{totals.unrouted_rows} of {totals.layer_rows} (token, layer) rows "
                f"({totals.unrouted_rows / rows:.2%}) have no engine route ({totals.offset_rows} "
                f"tokens before start offsets, {totals.rejected_rows} rejected rows, the rest "
                f"missing in the input), above --max-missing-fraction "
                f"{args.max_missing_fraction}: they would be routed by the "
                f"{'router' if args.missing_route_policy == 'native' else 'balanced fill'}, not "
                "replayed; nothing written"
            )

    def summary(self) -> str:
        """What was fixed and rejected, for the tools' last line."""
        totals = self.totals
        return (
            f"fixed: {totals.appended_rows} T-1 rows appended, {totals.offset_rows} rows before "
            f"start offsets, {totals.filled_rows} rows filled ({self.args.missing_route_policy}); "
            f"rejected: {totals.rejected_rows} invalid rows; without an engine route: "
            f"{totals.unrouted_rows} of {totals.layer_rows} (token, layer) rows"
        )


def check_token_ids(name: str, ids: list, document: np.ndarray, index: int) -> None:
    """Refuses a record whose token ids are not token document ``index``'s (another order)."""
    if len(ids) == document.size and all(type(i) is int for i in ids):
        differ = np.flatnonzero(np.asarray(ids, dtype=np.int64) != document)
        if not differ.size:
            return
        at = int(differ[0])
        raise ValueError(
            f"{name}: token {at} is {ids[at]} but token document {index} has {int(document[at])} "
            "there: the records are not in the order of --tokens-prefix's documents"
        )
    raise ValueError(
        f"{name}: its {len(ids)} token ids are not token document {index}'s {document.size}"
    )
