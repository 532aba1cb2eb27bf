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
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import check_output_prefix
from megatron_ext.data.tool_errors import add_common_flags, run_tool
from megatron_ext.replay.route_conversion import RouteConverter, add_route_flags, check_token_ids
from megatron_ext.replay.route_file import HEADER_EXTENSION
from megatron_ext.replay.route_records import FORMATS

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

OUTPUT_EXTENSIONS = (".bin", ".idx", HEADER_EXTENSION)


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, action="append", help="input file (repeatable)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx/.routes.json")
    add_route_flags(p)
    p.add_argument(
        "--tokens-prefix",
        help="token IndexedDataset: check document count, lengths and (where records carry them) "
        "token ids against it and record its digest (without it rewritten tokens cannot be "
        "caught, and replay refuses the routes unless --route-replay-allow-undigested)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    converter = RouteConverter.from_args(args)
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
    from megatron_ext.replay.route_dataset import write_route_sidecar

    write_route_sidecar(
        args.output_prefix,
        _converted(args, converter, tokens),
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        overwrite=args.overwrite,
        flag="--output-prefix",
        inputs=tuple(inputs),
        tokens_prefix=args.tokens_prefix,
        moe_layer_ids=converter.moe_layer_ids,
    )
    totals = converter.totals
    print(
        f"wrote {args.output_prefix}.bin/.idx/{HEADER_EXTENSION}: {totals.documents} documents, "
        f"{totals.tokens} tokens; {converter.summary()}"
    )
    return 0


def _converted(
    args: argparse.Namespace, converter: RouteConverter, tokens: "IndexedDataset | None"
) -> Iterator[np.ndarray]:
    """The route documents, converted one at a time; after the last, the whole-output checks
    (raised here, the writer then leaves nothing behind)."""
    token_lengths = None if tokens is None else tokens.sequence_lengths
    documents = converter.documents(args.input, args.format)
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
                check_token_ids(doc.name, doc.token_ids, np.asarray(tokens[index]), index)
        yield converter.convert(doc, index, num_tokens)
    if index < 0:  # as preprocess_data refuses an empty input: a 0-document sidecar is no data
        raise ValueError(
            f"--input {', '.join(args.input)} holds no route records: nothing to write"
        )
    if token_lengths is not None and index + 1 != len(token_lengths):
        raise ValueError(
            f"{index + 1} route documents for {len(token_lengths)} token documents "
            f"in --tokens-prefix {args.tokens_prefix}"
        )
    converter.check_fractions()


if __name__ == "__main__":
    sys.exit(run_tool(main))
