"""JSONL -> Megatron IndexedDataset (+ per-token loss-mask sidecar), tokenized locally.

    python tools/preprocess_data.py --input data.jsonl --output-prefix /data/sft \\
        --prompt-key prompt --response-key response --append-eod
    # -> /data/sft.bin/.idx and /data/sft_loss_mask.bin/.idx; train with
    #    --data-path /data/sft --pack-documents --pack-loss-mask-suffix _loss_mask

Outputs are written to temporary files and renamed at the end, tokens and mask in one commit (a
job reading the old files keeps them; a killed run never leaves new tokens beside an old mask that
would load); an existing output prefix, or a loss-mask sidecar of it, is refused unless
--overwrite, which also removes a stale sidecar when no mask is written. --tokenizer-file takes a tokenizer.json or a Hugging Face
tokenizer directory (its tokenizer_config.json eos_token is the default --eod-id). Token ids are stored exactly (uint16, else int32) or refused.
Errors are one line (file:line, flag), exit status 2; --debug shows the traceback.
"""

import argparse
import glob
import os
import sys

import numpy as np
from tqdm import tqdm

import megatron_ext.cli_quiet  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.data.indexed_writer import write_prefixes
from megatron_ext.data.jsonl_documents import (
    BYTE_EOD_ID,
    byte_tokenizer,
    hf_tokenizer,
    read_documents,
)
from megatron_ext.data.safe_files import check_output_prefix
from megatron_ext.data.tool_errors import add_common_flags, run_tool


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one record per line")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx")
    p.add_argument("--text-key", default="text", help="field with the text (default: text)")
    p.add_argument("--prompt-key", help="field with the prompt (loss-masked); needs --response-key")
    p.add_argument("--response-key", help="field with the response (trained on)")
    p.add_argument(
        "--tokenizer-file",
        "--tokenizer-model",
        dest="tokenizer_file",
        help="local Hugging Face tokenizer.json, or a tokenizer directory (save_pretrained "
        "layout,\nthe DIR of Megatron's --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
        "DIR);\ndefault: built-in byte-level (vocab 257)",
    )
    p.add_argument("--append-eod", action="store_true", help="end every document with --eod-id")
    p.add_argument(
        "--eod-id",
        type=int,
        default=None,
        help=f"default {BYTE_EOD_ID} (byte-level), or the eos_token of a tokenizer directory",
    )
    p.add_argument(
        "--loss-mask-suffix",
        default="_loss_mask",
        help="sidecar PREFIX+SUFFIX written with --prompt-key (default: _loss_mask)",
    )
    add_common_flags(p)
    return p


#: Largest token id an IndexedDataset stores exactly here (int32).
MAX_TOKEN_ID = 2**31 - 1


def _token_dtype(top: int) -> type[np.number]:
    """uint16 when every id fits, else int32; ids beyond int32 are refused (never wrapped)."""
    if top > MAX_TOKEN_ID:
        raise ValueError(f"token id {top} exceeds the largest storable id {MAX_TOKEN_ID} (int32)")
    return np.uint16 if top < 2**16 else np.int32


def check_outputs(args: argparse.Namespace) -> list[str]:
    """Refuses, before any work, outputs that exist (without --overwrite) or are inputs.

    Returns:
        The output prefixes: the tokens, then the loss-mask sidecar (written with --prompt-key,
        else removed if present).
    """
    inputs = [args.input] + ([args.tokenizer_file] if args.tokenizer_file else [])
    if not args.loss_mask_suffix:  # also without --prompt-key: a stale mask there is removed
        raise ValueError(
            "--loss-mask-suffix must not be empty: the loss mask would overwrite the tokens"
        )
    # The mask prefix is an output either way: written with --prompt-key, else any old mask
    # there is removed (it would not match the new tokens), which also needs --overwrite.
    outputs = [args.output_prefix, args.output_prefix + args.loss_mask_suffix]
    for prefix in outputs:
        check_output_prefix(
            prefix, flag="--output-prefix", input_files=inputs, overwrite=args.overwrite
        )
    return outputs


def _utf8_lines(f, path: str):
    """Decoded lines of a binary file; a line that is not UTF-8 is named."""
    for lineno, raw in enumerate(f, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} line {lineno} is not UTF-8 ({err.reason})") from err


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input} does not exist")
    if (args.prompt_key is None) != (args.response_key is None):
        raise ValueError("--prompt-key and --response-key must be given together")
    if args.eod_id is not None and not 0 <= args.eod_id <= MAX_TOKEN_ID:
        raise ValueError(f"--eod-id must be in [0, {MAX_TOKEN_ID}], got {args.eod_id}")
    if args.eod_id is not None and not args.append_eod:
        print("warning: --eod-id has no effect without --append-eod", file=sys.stderr)
    outputs = check_outputs(args)
    if args.tokenizer_file is not None:
        if not os.path.exists(args.tokenizer_file):
            raise ValueError(f"--tokenizer-file {args.tokenizer_file} does not exist")
        hf = hf_tokenizer(args.tokenizer_file)
        tokenize = hf.tokenize
        eod_id = hf.eos_id if args.eod_id is None else args.eod_id
        if args.append_eod and eod_id is None:
            raise ValueError(
                "--append-eod with --tokenizer-file needs --eod-id (or a tokenizer directory "
                "whose tokenizer_config.json names an eos_token)"
            )
        if args.append_eod and eod_id >= hf.vocab_size:
            raise ValueError(
                f"--eod-id {eod_id} is outside the vocabulary of --tokenizer-file "
                f"{args.tokenizer_file} ({hf.vocab_size} ids)"
            )
    else:
        tokenize, eod_id = (
            byte_tokenizer,
            BYTE_EOD_ID if args.eod_id is None else args.eod_id,
        )
    with open(args.input, "rb") as f:
        total = sum(1 for _ in f)
    with open(args.input, "rb") as f:
        docs = list(
            tqdm(
                read_documents(
                    _utf8_lines(f, args.input),
                    tokenize,
                    text_key=args.text_key,
                    prompt_key=args.prompt_key,
                    response_key=args.response_key,
                    eod_id=eod_id if args.append_eod else None,
                    source=args.input,
                ),
                total=total,
                desc="tokenizing",
                unit="doc",
            )
        )
    if not docs:
        raise ValueError(f"--input {args.input} holds no records: nothing to write")
    if not any(d[0].size for d in docs):  # an empty .bin: Megatron cannot even mmap it
        raise ValueError(f"--input {args.input} holds only empty documents (0 tokens)")
    vocab_top = max((int(d[0].max()) for d in docs if d[0].size), default=0)
    dtype = _token_dtype(vocab_top)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    # One commit (write_prefixes): tokens and mask are both written before any old file goes; a
    # loss mask of the old data never survives beside the new tokens (replaced by the new one,
    # or removed when none is written), and a crash leaves no old/new mix that would load.
    tokens = (args.output_prefix, (d[0] for d in tqdm(docs, desc="writing")), dtype, None)
    if args.prompt_key is not None:
        write_prefixes([(outputs[1], (d[1] for d in docs), np.uint8, None), tokens])
    else:
        write_prefixes([tokens], remove=[outputs[1]])
    others = sorted(
        set(glob.glob(glob.escape(args.output_prefix) + "?*.idx")) - {p + ".idx" for p in outputs}
    )
    if args.overwrite and others:
        print(
            f"warning: {', '.join(others)} beside the rewritten {args.output_prefix} were not "
            "rewritten and may no longer match it",
            file=sys.stderr,
        )
    num_tokens = sum(d[0].size for d in docs)
    print(f"wrote {len(docs)} documents, {num_tokens} tokens to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
