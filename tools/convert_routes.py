"""Rollout route dumps -> route sidecar IndexedDataset (uint8/uint16 [T, L, K] per document).

    python tools/convert_routes.py --input rollouts.jsonl --format vllm \\
        --model-config /models/dsv3/config.json --output-prefix /data/rl_routes \\
        --tokens-prefix /data/rl
    # -> /data/rl_routes.bin/.idx/.routes.json; train with --data-path /data/rl --pack-documents
    #    --route-replay-mode replay --route-data-suffix _routes

Formats (one record per JSONL line, in the order of the token documents; a line holding a JSON
list is one record per element; each source file named is read from the engine's release):
  vllm      vLLM 0.34 Completion/ChatCompletion responses, one per line: each choice one
            document; choices[i].routed_experts = base64 of a whole .npy file [T-1-S, N, K]
            (entrypoints/openai/*/serving.py numpy2base64, utils/serial_utils.py; N = all
            decoder layers, model_executor/layers/fused_moe/routed_experts_capturer.py); tokens
            from prompt_token_ids + the choice's token_ids (request return_token_ids: true);
            S = min(routed_experts_prompt_start, P) (distributed/aux_output_connector/connector.py).
            vLLM 0.21 responses: prompt_routed_experts [P, L, K] + each choice's routed_experts
            [C-1, L, K], nested lists, MoE layers only (v1/engine/output_processor.py).
            Records {"routed_experts": .npy base64, nested lists or prime-rl's {"data": base64,
            "shape", "dtype"}, "num_tokens": T or "token_ids": [...]}.
  megatron  {"prompt_moe_topk_indices": [...], "moe_topk_indices": [...], "num_tokens": T
             or "token_ids": [...]} (Megatron inference; T - 1 rows in total)
  sglang    SGLang 0.5.23 /generate responses (or batched lists of them) {"meta_info":
            {"routed_experts": base64 of int32 [T-1-S, N, K], "prompt_tokens": P,
            "completion_tokens": C}} (managers/tokenizer_manager.py; rows [S, T-1),
            state_capturer/base.py get_topk; N = num_hidden_layers), samples {"tokens": [...],
            "meta_info": {...}}, OpenAI-compatible responses with sglext.routed_experts
            (entrypoints/openai/serving_chat.py; n = 1) or each choice's meta_info.
  npy       one .npy [T, L, K] per --input (repeat --input for several documents)
  safetensors  one file, one tensor [T, L, K] per document, keyed "0".."N-1" (numeric order)
Element types are the format's (SGLang int32, vLLM the .npy header's), never guessed from a byte
count. Rows before the start offset S and the last token's row are missing; the policy decides
them at train time ('native') or here ('balanced'). Dense layers: engines return one row per
decoder layer (dense ones zero); --moe-layer-ids or --model-config select the MoE rows and
check the dense ones are zero. Invalid rows (ids out of range, duplicates) raise, or with
--reject-invalid-rows become missing and are counted. An output whose rejected or missing
fraction exceeds --max-rejected-fraction / --max-missing-fraction is refused. The output gets a
header PREFIX.routes.json (L, K, E, decoder layers, tokens digest) the dataset checks; an
existing output is refused unless --overwrite. Input is streamed (memory holds one record).
Errors are one line (file:line, the choice), exit status 2; --debug shows the traceback.
"""

import argparse
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import check_output_prefix
from megatron_ext.data.tool_errors import add_common_flags, run_tool
from megatron_ext.replay.moe_layer_map import (
    MoeLayerMap,
    parse_layer_ids,
    read_model_config,
    select_moe_rows,
)
from megatron_ext.replay.rollout_routes import RepairCounts, repair_document
from megatron_ext.replay.route_file import HEADER_EXTENSION
from megatron_ext.replay.route_records import FORMATS, T_MINUS_ONE_FORMATS, read_documents
from megatron_ext.replay.routes import route_dtype

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

OUTPUT_EXTENSIONS = (".bin", ".idx", HEADER_EXTENSION)
#: Defaults of the fraction limits (docs/replay.md says why).
MAX_REJECTED_FRACTION = 0.01
MAX_MISSING_FRACTION = 0.05


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, action="append", help="input file (repeatable)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx/.routes.json")
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
    p.add_argument(
        "--tokens-prefix",
        help="token IndexedDataset: check document count, lengths and (where records carry them) "
        "token ids against it and record its digest (without it rewritten tokens cannot be "
        "caught, and replay refuses the routes unless --route-replay-allow-undigested)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common_flags(p)
    return p


def _layer_map(args: argparse.Namespace) -> MoeLayerMap | None:
    """The layer map from --model-config / --moe-layer-ids; fills L, K, E from it."""
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
    for flag, value in (
        ("--num-layers", None if layer_map is None else len(layer_map.moe_layer_ids)),
        ("--topk", None if layer_map is None else layer_map.topk),
        ("--num-experts", None if layer_map is None else layer_map.num_experts),
    ):
        attr = flag[2:].replace("-", "_")
        given = getattr(args, attr)
        if given is not None and value is not None and given != value:
            raise ValueError(f"{flag} {given} disagrees with the layer map's {value}")
        if given is None and value is None:
            raise ValueError(f"{flag} is required (or give --model-config)")
        setattr(args, attr, given if given is not None else value)
    return layer_map


def _check_args(args: argparse.Namespace) -> MoeLayerMap | None:
    layer_map = _layer_map(args)
    if args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    route_dtype(args.num_experts, args.topk)  # rejects impossible E / K early
    if args.routed_experts_start < 0:
        raise ValueError(f"--routed-experts-start must be >= 0, got {args.routed_experts_start}")
    for flag in ("--max-rejected-fraction", "--max-missing-fraction"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{flag} must be in [0, 1], got {value}")
    for path in args.input:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path} does not exist")
    return layer_map


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    layer_map = _check_args(args)
    inputs = list(args.input) + ([args.tokens_prefix] if args.tokens_prefix else [])
    # Before the work: an existing output, or one that is an input, is refused now.
    check_output_prefix(
        args.output_prefix,
        flag="--output-prefix",
        inputs=inputs,
        overwrite=args.overwrite,
        extensions=OUTPUT_EXTENSIONS,
    )
    tokens = None
    if args.tokens_prefix:
        from megatron_ext.data.indexed_checks import open_indexed

        tokens = open_indexed(args.tokens_prefix, "--tokens-prefix")
    totals = RepairCounts()
    from megatron_ext.replay.route_dataset import write_route_sidecar

    write_route_sidecar(
        args.output_prefix,
        _converted(args, layer_map, tokens, totals),
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        overwrite=args.overwrite,
        flag="--output-prefix",
        inputs=tuple(inputs),
        tokens_prefix=args.tokens_prefix,
        moe_layer_ids=None if layer_map is None else layer_map.moe_layer_ids,
    )
    print(
        f"wrote {args.output_prefix}.bin/.idx/{HEADER_EXTENSION}: {totals.documents} documents, "
        f"{totals.tokens} tokens; fixed: {totals.appended_rows} T-1 rows appended, "
        f"{totals.offset_rows} rows before start offsets, {totals.filled_rows} rows filled "
        f"({args.missing_route_policy}); rejected: {totals.rejected_rows} invalid rows; "
        f"without an engine route: {totals.unrouted_rows} of {totals.layer_rows} (token, layer) rows"
    )
    return 0


def _converted(
    args: argparse.Namespace,
    layer_map: MoeLayerMap | None,
    tokens: "IndexedDataset | None",
    totals: RepairCounts,
) -> Iterator[np.ndarray]:
    """The route documents, converted one at a time; after the last, the whole-output checks
    (raised here, the writer then leaves nothing behind)."""
    token_lengths = None if tokens is None else tokens.sequence_lengths
    wire_layers = args.num_layers
    if layer_map is not None and layer_map.num_decoder_layers is not None:
        wire_layers = layer_map.num_decoder_layers  # shapeless payloads carry every layer
    documents = read_documents(
        args.input,
        args.format,
        wire_layers=wire_layers,
        topk=args.topk,
        start=args.routed_experts_start,
    )
    index = -1
    for index, doc in enumerate(
        tqdm(documents, desc="routes", unit="doc", disable=args.no_progress)
    ):
        num_tokens = doc.num_tokens
        if token_lengths is not None:
            if index >= len(token_lengths):
                raise ValueError(
                    f"{doc.name}: more route documents than --tokens-prefix documents "
                    f"({len(token_lengths)})"
                )
            if num_tokens is not None and num_tokens != token_lengths[index]:
                raise ValueError(
                    f"{doc.name}: {num_tokens} tokens but token document {index} "
                    f"has {int(token_lengths[index])} tokens"
                )
            num_tokens = int(token_lengths[index])
            if doc.token_ids is not None:
                _check_token_ids(doc.name, doc.token_ids, np.asarray(tokens[index]), index)
        if num_tokens is None and args.format in T_MINUS_ONE_FORMATS:
            # These engines return T - 1 rows for T tokens: taking the rows as complete would
            # silently make the document's routes one row short of its tokens.
            raise ValueError(
                f"{doc.name}: a --format {args.format} record holds T - 1 rows for T tokens; give "
                "its num_tokens or token_ids, or pass --tokens-prefix"
            )
        rows = doc.rows_TLK
        if layer_map is not None and rows.ndim == 3 and rows.shape != (0, 0, 0):  # [] has no N
            rows = select_moe_rows(rows, layer_map, doc.name)
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
        totals.add(counts)
        yield routes
    if index < 0:  # as preprocess_data refuses an empty input: a 0-document sidecar is no data
        raise ValueError(
            f"--input {', '.join(args.input)} holds no route records: nothing to write"
        )
    if token_lengths is not None and index + 1 != len(token_lengths):
        raise ValueError(
            f"{index + 1} route documents for {len(token_lengths)} token documents "
            f"in --tokens-prefix {args.tokens_prefix}"
        )
    _check_fractions(args, totals)


def _check_token_ids(name: str, ids: list, document: np.ndarray, index: int) -> None:
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


def _check_fractions(args: argparse.Namespace, totals: RepairCounts) -> None:
    """Refuses an output that would mostly replay nothing (nothing is written)."""
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
            f"tokens before start offsets, {totals.rejected_rows} rejected rows, the rest missing "
            f"in the input), above --max-missing-fraction "
            f"{args.max_missing_fraction}: they would be routed by the "
            f"{'router' if args.missing_route_policy == 'native' else 'balanced fill'}, not "
            "replayed; nothing written"
        )


if __name__ == "__main__":
    sys.exit(run_tool(main))
