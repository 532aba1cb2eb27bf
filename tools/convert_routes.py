"""Rollout route dumps -> route sidecar IndexedDataset (uint8/uint16 [T, L, K] per document).

    python tools/convert_routes.py --input rollouts.jsonl --format vllm \\
        --num-layers 48 --topk 8 --num-experts 128 --output-prefix /data/rl_routes \\
        --tokens-prefix /data/rl --missing-route-policy native
    # -> /data/rl_routes.bin/.idx; train with --data-path /data/rl --pack-documents
    #    --route-replay-mode replay --route-data-suffix _routes

Formats (one document per JSONL line, in the order of the token documents):
  vllm      {"routed_experts": [[[...]]] or {"data": base64, "shape": [T-1, L, K],
             "dtype": "uint8"}, "num_tokens": T or "token_ids": [...]}
  megatron  {"prompt_moe_topk_indices": [...], "moe_topk_indices": [...], "num_tokens": T
             or "token_ids": [...]} (Megatron inference; T - 1 rows in total)
  sglang    SGLang /generate responses {"meta_info": {"routed_experts": base64 of int32
             [T-1, L, K] or nested lists, "prompt_tokens": P, "completion_tokens": C}, ...}
             with T = P + C, or samples {"tokens" or "token_ids": [...], "meta_info": {...}}
  npy       one .npy [T, L, K] per --input (repeat --input for several documents)
  safetensors  one file, one tensor [T, L, K] per document, keyed "0".."N-1" (numeric order)
T - 1 rows get a final missing row; the policy decides it (and tool tokens, pads) at train time
('native') or here ('balanced'). Invalid rows (ids out of range, duplicates) raise, or with
--reject-invalid-rows become missing and are counted. Every input value is an expert id (the
payload dtype's maximum too); ids are never rounded or cast, and num_tokens must agree with
token_ids. The output gets a header PREFIX.routes.json (L, K, E) that the dataset checks; an
existing output is refused unless --overwrite. Errors are one line (file:line or file and key),
exit status 2; --debug shows the traceback.

Field names and layouts were checked against the engines' source (read, not run):
  vLLM     vllm/outputs.py at commit 003d3ee2: CompletionOutput.routed_experts, an array
           [seq_len, layer_num, topk] (the base64 {"data", "shape", "dtype"} object is
           prime-rl's wire form of it; OpenAI-style responses add a top-level
           prompt_routed_experts, which this tool does not read).
  SGLang   python/sglang/srt/layers/moe/routed_experts_capturer.py at commit d4d0fc58
           (int32 host buffer [tokens, num_hidden_layers, topk]; a request's routes are its
           seqlen - 1 rows; extract_routed_experts_from_meta_info decodes base64 -> int32), and
           python/sglang/srt/managers/{tokenizer,detokenizer}_manager.py of a recent main
           (stored copy, commit not recorded): meta_info["routed_experts"] = base64 of the
           tensor's bytes.
           SGLang's L is num_hidden_layers: for a model whose every layer is MoE, --num-layers.
"""

import argparse
import json
import os
import sys
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

import megatron_ext.cli_quiet  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.data.safe_files import check_output_prefix
from megatron_ext.data.tool_errors import add_common_flags, run_tool
from megatron_ext.replay.rollout_routes import (
    RepairCounts,
    check_route_array,
    decode_routed_experts,
    read_safetensors,
    refuse_duplicate_keys,
    repair_document,
    safetensors_documents,
)
from megatron_ext.replay.route_file import HEADER_EXTENSION
from megatron_ext.replay.routes import route_dtype
from megatron_ext.replay.sglang_routes import decode_sglang_record

OUTPUT_EXTENSIONS = (".bin", ".idx", HEADER_EXTENSION)


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, action="append", help="input file (repeatable)")
    p.add_argument(
        "--format", required=True, choices=["vllm", "megatron", "sglang", "npy", "safetensors"]
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx")
    p.add_argument("--num-layers", type=int, required=True, help="MoE layers L (MTP excluded)")
    p.add_argument("--topk", type=int, required=True, help="experts per token K")
    p.add_argument("--num-experts", type=int, required=True, help="routed experts E")
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
        "--tokens-prefix", help="token IndexedDataset: check document count and lengths against it"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common_flags(p)
    return p


def _num_tokens(record: dict, name: str) -> int | None:
    """T from ``num_tokens`` and/or ``token_ids``; both given must agree (neither wins)."""
    count = None
    if "num_tokens" in record:
        count = record["num_tokens"]
        if type(count) is not int or count < 0:
            raise ValueError(f"{name}: num_tokens must be a non-negative integer, got {count!r}")
    if "token_ids" in record:
        ids = record["token_ids"]
        if not isinstance(ids, list):
            raise ValueError(f"{name}: token_ids must be a list, got {type(ids).__name__}")
        if count is not None and count != len(ids):
            raise ValueError(f"{name}: num_tokens {count} disagrees with the {len(ids)} token_ids")
        count = len(ids)
    return count


def _load_npy(path: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npy of integer ids ({err})") from err
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{path}: holds several arrays (.npz), expected one [T, L, K] array")
    check_route_array(array, path)
    return array


def read_documents(
    paths: list[str], fmt: str, *, num_layers: int = 0, topk: int = 0
) -> Iterator[tuple[str, np.ndarray, int | None]]:
    """Yields ``(name, rows_TLK, num_tokens or None)`` per document, in order.

    ``num_layers`` and ``topk`` shape SGLang's base64 payloads, which carry no shape.
    """
    for path in paths:
        if fmt == "npy":
            yield path, _load_npy(path), None
        elif fmt == "safetensors":
            for key, array in safetensors_documents(read_safetensors(path), path):
                yield f"{path}[{key}]", array, None
        else:
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    name = f"{path}:{line_no}"
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as err:
                        raise ValueError(f"{name}: not UTF-8 ({err.reason})") from err
                    if not line.strip():
                        continue
                    yield (name, *_decode_line(line, fmt, name, num_layers, topk))


_ROUTE_KEYS = {
    "vllm": ("routed_experts",),
    "megatron": ("prompt_moe_topk_indices", "moe_topk_indices"),
}


#: Formats whose records hold one row fewer than their tokens (T is needed to know it).
_T_MINUS_ONE_FORMATS = ("vllm", "megatron", "sglang")


def _decode_line(
    line: str, fmt: str, name: str, num_layers: int, topk: int
) -> tuple[np.ndarray, int | None]:
    """One JSONL record -> ``(rows_TLK, num_tokens or None)``; errors name ``file:line``."""
    try:
        record = json.loads(line, object_pairs_hook=refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc})") from exc
    except ValueError as exc:  # the duplicate-key hook
        raise ValueError(f"{name}: {exc}") from exc
    if fmt == "sglang":
        return decode_sglang_record(record, num_layers=num_layers, topk=topk, name=name)
    keys = _ROUTE_KEYS[fmt]
    if not isinstance(record, dict) or not any(key in record for key in keys):
        raise ValueError(
            f"{name}: a --format {fmt} record needs a {' or '.join(map(repr, keys))} key"
        )
    num_tokens = _num_tokens(record, name)
    # A boolean can only be there if the JSON text spells one: else skip the scan for them.
    booleans = "true" in line or "false" in line
    if fmt == "vllm":
        rows = decode_routed_experts(
            record["routed_experts"], f"{name} routed_experts", may_hold_booleans=booleans
        )
        return rows, num_tokens
    # A key that is present is decoded whatever it holds (0 or "" is refused there, not skipped;
    # null counts as absent); an empty part (no rows, e.g. an empty prompt) adds nothing.
    parts = [
        decode_routed_experts(record[key], f"{name} {key}", may_hold_booleans=booleans)
        for key in keys
        if record.get(key, None) is not None
    ]
    parts = [p for p in parts if p.shape != (0, 0, 0)]
    shapes = {p.shape[1:] for p in parts}
    if len(shapes) > 1:
        raise ValueError(f"{name}: {' and '.join(keys)} have different [layers, topk] {shapes}")
    rows = np.concatenate(parts) if parts else np.zeros((0, 0, 0), dtype=np.int64)
    return rows, num_tokens


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    route_dtype(args.num_experts, args.topk)  # rejects impossible E / K early
    for path in args.input:
        if not os.path.isfile(path):
            raise ValueError(f"--input {path} does not exist")
    inputs = list(args.input) + ([args.tokens_prefix] if args.tokens_prefix else [])
    # Before the work: an existing output, or one that is an input, is refused now.
    check_output_prefix(
        args.output_prefix,
        flag="--output-prefix",
        inputs=inputs,
        overwrite=args.overwrite,
        extensions=OUTPUT_EXTENSIONS,
    )
    token_lengths = None
    if args.tokens_prefix:
        from megatron_ext.data.indexed_checks import open_indexed

        tokens = open_indexed(args.tokens_prefix, "--tokens-prefix")
        # Copy while ``tokens`` lives: the lengths are a view of its index mmap.
        token_lengths = np.array(tokens.sequence_lengths)
        del tokens
    totals, docs = RepairCounts(), []
    stream = tqdm(
        read_documents(args.input, args.format, num_layers=args.num_layers, topk=args.topk),
        desc="routes",
        unit="doc",
        disable=args.no_progress,
    )
    for index, (name, rows, num_tokens) in enumerate(stream):
        if token_lengths is not None:
            if index >= len(token_lengths):
                raise ValueError(
                    f"{name}: more route documents than --tokens-prefix documents "
                    f"({len(token_lengths)})"
                )
            if num_tokens is not None and num_tokens != token_lengths[index]:
                raise ValueError(
                    f"{name}: num_tokens {num_tokens} but token document {index} "
                    f"has {int(token_lengths[index])} tokens"
                )
            num_tokens = int(token_lengths[index])
        if num_tokens is None and args.format in _T_MINUS_ONE_FORMATS:
            # These engines return T - 1 rows for T tokens: taking the rows as complete would
            # silently make the document's routes one row short of its tokens.
            raise ValueError(
                f"{name}: a --format {args.format} record holds T - 1 rows for T tokens; give its "
                "num_tokens or token_ids, or pass --tokens-prefix"
            )
        routes, counts = repair_document(
            rows,
            num_tokens,
            num_layers=args.num_layers,
            topk=args.topk,
            num_experts=args.num_experts,
            policy=args.missing_route_policy,
            reject_invalid=args.reject_invalid_rows,
            name=name,
            seed=index,
        )
        totals.add(counts)
        docs.append(routes)
    if not docs:  # as preprocess_data refuses an empty input: a 0-document sidecar is no data
        raise ValueError(
            f"--input {', '.join(args.input)} holds no route records: nothing to write"
        )
    if token_lengths is not None and len(docs) != len(token_lengths):
        raise ValueError(
            f"{len(docs)} route documents for {len(token_lengths)} token documents "
            f"in --tokens-prefix {args.tokens_prefix}"
        )
    from megatron_ext.replay.route_dataset import write_route_sidecar

    write_route_sidecar(
        args.output_prefix,
        docs,
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        overwrite=args.overwrite,
        flag="--output-prefix",
        inputs=tuple(inputs),
        tokens_prefix=args.tokens_prefix,
    )
    print(
        f"wrote {args.output_prefix}.bin/.idx/{HEADER_EXTENSION}: {totals.documents} documents, {totals.tokens} "
        f"tokens; fixed: {totals.appended_rows} T-1 rows appended, {totals.filled_rows} rows "
        f"filled ({args.missing_route_policy}); rejected: {totals.rejected_rows} invalid rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
