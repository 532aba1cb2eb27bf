"""Rollout records -> the training data of an RL step, in one streaming pass: tokens, loss mask,
route sidecar and per-token sidecars, all beside --output-prefix and keyed by one tokens digest.

    python tools/ingest_rollouts.py --input rollouts.jsonl --format vllm \\
        --model-config /models/dsv3/config.json --output-prefix /data/rl \\
        --token-keys logprobs --sequence-keys advantages=advantage
    # -> /data/rl.bin/.idx                      prompt + completion ids, a document per sequence
    #    /data/rl_loss_mask.bin/.idx            1 on completion tokens, 0 on the prompt
    #    /data/rl_routes.bin/.idx/.routes.json  the engine's routes (what convert-routes writes)
    #    /data/rl_logprobs.bin/.idx             per completion token (float32; prompt 0)
    #    /data/rl_advantages.bin/.idx           the per-sequence value on every completion token
    #    (each sidecar with a P_S.sidecar.json header: name, scope, tokens_digest)
    # train with --data-path /data/rl --pack-documents --pack-loss-mask-suffix _loss_mask
    #    --route-replay-mode replay --route-data-suffix _routes

Formats (--format; one record per JSONL line, a JSON list is one record per element, in order):
vLLM 0.34 / 0.21 Completion and ChatCompletion responses (n >= 1 choices, each a sequence; the
request's return_token_ids: true), SGLang 0.5.23 /generate answers (return_prompt_token_ids:
true, or samples with tokens) and OpenAI-compatible answers with token ids, and records with
prompt_ids + completion_ids (prime-rl) or prompt_token_ids + completion_token_ids beside the
routes (--format vllm: routed_experts; --format megatron: moe_topk_indices). The routes are
converted by convert-routes' own code (megatron_ext/replay/route_conversion.py) with its flags:
--model-config or --num-layers/--topk/--num-experts, --moe-layer-ids, --vllm-moe-rows, limits.

Nothing is inferred from counts: a record without token ids or a prompt/completion split, a
per-token key missing or of another length than the completion, a NaN or infinite value, or any
disagreement between a record and the flags is one line naming the record (file:line, choice),
exit status 2, and nothing is written (every output goes to temporary files renamed into place
together at the end). An existing output is refused unless --overwrite.
"""

import argparse
import sys

import numpy as np
from tqdm import tqdm

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import check_output_prefix, content_digest
from megatron_ext.data.sidecar_header import SIDECAR_EXTENSION, sidecar_header_bytes
from megatron_ext.data.tool_errors import add_common_flags, run_tool
from megatron_ext.replay.rollout_ingest import (
    TOKEN_DTYPE,
    VALUE_DTYPE,
    TokenKey,
    parse_token_keys,
    sequence_tokens,
    token_values,
)
from megatron_ext.replay.route_conversion import RouteConverter, add_route_flags
from megatron_ext.replay.route_file import HEADER_EXTENSION, header_bytes
from megatron_ext.replay.routes import route_dtype

#: Formats whose records carry token ids (npy / safetensors hold routes only).
INGEST_FORMATS = ("vllm", "sglang", "megatron")


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, action="append", help="input file (repeatable)")
    p.add_argument("--format", required=True, choices=INGEST_FORMATS)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx and sidecars")
    p.add_argument(
        "--token-keys",
        help="per-token sidecars NAME[=KEY],... (PREFIX_NAME) from each record's KEY: one number "
        "per completion token (vLLM's logprobs object and SGLang's output_token_logprobs too)",
    )
    p.add_argument(
        "--sequence-keys",
        help="per-sequence values NAME[=KEY],... (e.g. reward, advantages=advantage) broadcast "
        "to the completion's tokens in PREFIX_NAME",
    )
    p.add_argument(
        "--loss-mask-suffix",
        default="_loss_mask",
        help="loss-mask sidecar PREFIX+SUFFIX (--pack-loss-mask-suffix; default _loss_mask)",
    )
    p.add_argument(
        "--route-suffix",
        default="_routes",
        help="route sidecar PREFIX+SUFFIX (--route-data-suffix; default _routes)",
    )
    add_route_flags(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common_flags(p)
    return p


def _outputs(args: argparse.Namespace, keys: list[TokenKey]) -> list[tuple[str, type, tuple]]:
    """``(prefix, dtype, extensions)`` of every output: tokens, loss mask, routes, the keys'."""
    for flag in ("--loss-mask-suffix", "--route-suffix"):
        if not getattr(args, flag[2:].replace("-", "_")):
            raise ValueError(f"{flag} must not be empty: the sidecar would overwrite the tokens")
    prefix = args.output_prefix
    suffixes = [args.loss_mask_suffix, args.route_suffix, *(f"_{k.name}" for k in keys)]
    if len(set(suffixes)) != len(suffixes):
        raise ValueError(f"two outputs would share a suffix: {suffixes}")
    sidecar = (".bin", ".idx", SIDECAR_EXTENSION)
    return [
        (prefix, TOKEN_DTYPE, (".bin", ".idx")),
        (prefix + args.loss_mask_suffix, np.uint8, sidecar),
        (prefix + args.route_suffix, route_dtype(args.num_experts, args.topk).type,
         (".bin", ".idx", HEADER_EXTENSION)),
        *((prefix + f"_{k.name}", VALUE_DTYPE, sidecar) for k in keys),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Runs the ingestion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    converter = RouteConverter.from_args(args)
    keys = parse_token_keys(args.token_keys, "--token-keys", per_sequence=False)
    keys += parse_token_keys(args.sequence_keys, "--sequence-keys", per_sequence=True)
    outputs = _outputs(args, keys)
    for out_prefix, _dtype, extensions in outputs:  # before the work
        check_output_prefix(
            out_prefix,
            flag="--output-prefix",
            inputs=args.input,
            overwrite=args.overwrite,
            extensions=extensions,
        )
    from megatron_ext.data.indexed_writer import StreamingPrefixes

    with StreamingPrefixes([(p, dtype) for p, dtype, _ in outputs]) as out:
        lengths = _ingest(args, converter, keys, out)
        tokens_bin, tokens_idx = out.finalize()[0]
        digest = content_digest([tokens_idx, tokens_bin])  # = route_file.tokens_digest's
        out.commit(_headers(args, converter, keys, lengths, digest))
    totals = converter.totals
    print(
        f"wrote {args.output_prefix}.bin/.idx with {args.loss_mask_suffix}, {args.route_suffix}"
        f"{''.join(f', _{k.name}' for k in keys)}: {totals.documents} documents, "
        f"{totals.tokens} tokens ({int(lengths[1].sum())} completion tokens); routes "
        f"{converter.summary()}"
    )
    return 0


def _ingest(
    args: argparse.Namespace, converter: RouteConverter, keys: list[TokenKey], out
) -> tuple[np.ndarray, np.ndarray]:
    """Writes every document to the temporary outputs; returns (tokens, completion tokens) per
    document. The whole-output checks run after the last record (nothing is written yet)."""
    lengths, completions = [], []
    documents = converter.documents(args.input, args.format)
    for index, doc in enumerate(
        tqdm(documents, desc="rollouts", unit="seq", disable=args.no_progress)
    ):
        tokens_T, mask_T = sequence_tokens(doc)
        if doc.num_tokens is not None and doc.num_tokens != tokens_T.size:
            raise ValueError(
                f"{doc.name}: {doc.num_tokens} tokens counted but {tokens_T.size} token ids"
            )
        values = [token_values(doc, key, tokens_T.size) for key in keys]
        routes_TLK = converter.convert(doc, index, tokens_T.size)
        for output, array in enumerate([tokens_T, mask_T, routes_TLK, *values]):
            out.add_document(output, array)
        lengths.append(tokens_T.size)
        completions.append(int(mask_T.sum()))
    if not lengths:  # as convert-routes: a 0-document output is no data
        raise ValueError(f"--input {', '.join(args.input)} holds no rollout records")
    converter.check_fractions()
    return np.array(lengths, dtype=np.int64), np.array(completions, dtype=np.int64)


def _headers(
    args: argparse.Namespace,
    converter: RouteConverter,
    keys: list[TokenKey],
    lengths: tuple[np.ndarray, np.ndarray],
    digest: str,
) -> dict[int, dict[str, bytes]]:
    """The companions of outputs 1.. (loss mask, routes, keys), each naming the tokens' digest."""
    lengths_D = lengths[0]
    route_header = header_bytes(  # what convert-routes --tokens-prefix writes
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        dtype=route_dtype(args.num_experts, args.topk),
        lengths_D=lengths_D,
        tokens=digest,
        moe_layer_ids=converter.moe_layer_ids,
    )
    common = {"lengths_D": lengths_D, "tokens_digest": digest}
    headers = {
        1: {SIDECAR_EXTENSION: sidecar_header_bytes(
            name="loss_mask", key=None, scope="mask", dtype=np.uint8, **common)},
        2: {HEADER_EXTENSION: route_header},
    }  # fmt: skip
    for i, key in enumerate(keys, start=3):
        scope = "sequence" if key.per_sequence else "completion"
        headers[i] = {
            SIDECAR_EXTENSION: sidecar_header_bytes(
                name=key.name, key=key.key, scope=scope, dtype=VALUE_DTYPE, **common
            )
        }
    return headers


if __name__ == "__main__":
    sys.exit(run_tool(main))
