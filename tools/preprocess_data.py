"""JSONL -> Megatron IndexedDataset (+ per-token loss-mask sidecar), tokenized locally; the same
bytes as Megatron-LM's tools/preprocess_data.py for the same input and flags.

    python tools/preprocess_data.py --input data.jsonl --output-prefix /data/web \\
        --json-keys text --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR \\
        --append-eod --workers 4
    # -> /data/web_text_document.bin/.idx, as Megatron's script writes them
    python tools/preprocess_data.py --input data.jsonl --output-prefix /data/sft \\
        --prompt-key prompt --response-key response --append-eod
    # -> /data/sft.bin/.idx and /data/sft_loss_mask.bin/.idx; train with
    #    --data-path /data/sft --pack-documents --pack-loss-mask-suffix _loss_mask

As Megatron's script: a text is a string or a list of sentences (one sequence each); a sentence
with no ids is dropped and --append-eod ends only non-empty documents (an empty record is a
document of 0 sequences); the dtype follows the vocabulary size (uint16 below 65500 ids, else
int32); a tokenizer directory is built by Megatron's build_tokenizer and adds its special tokens
(e.g. BOS) unless --tokenizer-hf-no-include-special-tokens.
Outputs are written to temporary files and renamed at the end, tokens and mask in one commit; an
existing output, or a loss-mask sidecar of it, is refused unless --overwrite, which also removes
a stale sidecar when no mask is written.
Errors are one line (file:line, flag), exit status 2; --debug shows the traceback.
"""

import argparse
import glob
import os
import sys

import numpy as np
from tqdm import tqdm

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import check_output_prefix
from megatron_ext.data.jsonl_documents import RecordFormat
from megatron_ext.data.text_tokenizers import TokenizerSpec, load_tokenizer, special_prefix
from megatron_ext.data.tool_errors import add_common_flags, run_tool


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL file, one record per line")
    p.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX.bin/.idx, or PREFIX_{key}_document.bin/.idx per --json-keys key",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        help="keys to tokenize, one output each, named PREFIX_{key}_document (Megatron's flag "
        "and naming)",
    )
    p.add_argument(
        "--text-key", help="the one key to tokenize, written to PREFIX.bin/.idx (default: text)"
    )
    p.add_argument("--prompt-key", help="field with the prompt (loss-masked); needs --response-key")
    p.add_argument("--response-key", help="field with the response (trained on)")
    p.add_argument(
        "--tokenizer-type",
        choices=["HuggingFaceTokenizer"],
        help="Megatron's flag; the only type taken here (implied by --tokenizer-model)",
    )
    p.add_argument(
        "--tokenizer-model",
        "--tokenizer-file",
        dest="tokenizer_file",
        help="Hugging Face tokenizer directory (save_pretrained layout, the DIR of Megatron's\n"
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR), or a bare tokenizer.json;"
        "\ndefault: built-in byte-level (vocab 257)",
    )
    p.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="do not add the tokenizer's special tokens (e.g. BOS) to each text (Megatron's flag)",
    )
    p.add_argument(
        "--append-eod", action="store_true", help="end every non-empty document with --eod-id"
    )
    p.add_argument(
        "--eod-id",
        type=int,
        default=None,
        help=f"default {BYTE_EOD} (byte-level), or the eos_token of a tokenizer directory",
    )
    p.add_argument(
        "--loss-mask-suffix",
        default="_loss_mask",
        help="sidecar PREFIX+SUFFIX written with --prompt-key (default: _loss_mask)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes tokenizing (the output is the same for any number; default 1)",
    )
    add_common_flags(p)
    return p


BYTE_EOD = 256

#: Largest token id an IndexedDataset stores exactly here (int32).
MAX_TOKEN_ID = 2**31 - 1


def check_args(args: argparse.Namespace) -> None:
    """Refuses unsupported flag combinations before any work."""
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input} does not exist")
    if (args.prompt_key is None) != (args.response_key is None):
        raise ValueError("--prompt-key and --response-key must be given together")
    if args.json_keys is not None and args.text_key is not None:
        raise ValueError("--json-keys and --text-key are alternatives: give one")
    if args.prompt_key is not None and (args.json_keys or args.text_key):
        raise ValueError("--prompt-key/--response-key replace --json-keys/--text-key: give one")
    if args.json_keys and len(set(args.json_keys)) != len(args.json_keys):
        raise ValueError(f"--json-keys names a key twice: {args.json_keys}")
    if args.tokenizer_type and args.tokenizer_file is None:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.eod_id is not None and not 0 <= args.eod_id <= MAX_TOKEN_ID:
        raise ValueError(f"--eod-id must be in [0, {MAX_TOKEN_ID}], got {args.eod_id}")
    if args.tokenizer_hf_no_include_special_tokens and args.tokenizer_file is None:
        print(
            "warning: --tokenizer-hf-no-include-special-tokens has no effect on the byte-level "
            "tokenizer (it adds none)",
            file=sys.stderr,
        )
    if args.eod_id is not None and not args.append_eod:
        print("warning: --eod-id has no effect without --append-eod", file=sys.stderr)
    if not args.loss_mask_suffix:  # also without --prompt-key: a stale mask there is removed
        raise ValueError(
            "--loss-mask-suffix must not be empty: the loss mask would overwrite the tokens"
        )


def output_prefixes(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """Refuses, before any work, outputs that exist (without --overwrite) or are inputs.

    Returns:
        The token outputs (one per --json-keys key, else PREFIX), and the loss-mask sidecar
        (PREFIX+suffix: written with --prompt-key, else removed if present; None with
        --json-keys, whose outputs have no sidecar).
    """
    inputs = [args.input] + ([args.tokenizer_file] if args.tokenizer_file else [])
    if args.json_keys:
        tokens, mask = [f"{args.output_prefix}_{key}_document" for key in args.json_keys], None
    else:
        tokens, mask = [args.output_prefix], args.output_prefix + args.loss_mask_suffix
    for prefix in tokens + ([mask] if mask else []):
        check_output_prefix(
            prefix, flag="--output-prefix", input_files=inputs, overwrite=args.overwrite
        )
    return tokens, mask


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    # Megatron's IndexedDataset (its package imports torch) only once the flags parsed: --help and a
    # bad flag answer at once.
    from megatron_ext.data.jsonl_indexed import jsonl_to_indexed, token_dtype

    check_args(args)
    outputs, mask_prefix = output_prefixes(args)
    given = sys.argv[1:] if argv is None else argv
    file_flag = any(a.split("=")[0] == "--tokenizer-file" for a in given)
    flag = "--tokenizer-file" if file_flag else "--tokenizer-model"
    spec = TokenizerSpec(
        args.tokenizer_file, not args.tokenizer_hf_no_include_special_tokens, flag=flag
    )
    tok = load_tokenizer(spec)
    eod_id = tok.eos_id if args.eod_id is None else args.eod_id
    if args.append_eod and eod_id is None:
        raise ValueError(
            f"--append-eod with {flag} {args.tokenizer_file} needs --eod-id (or a tokenizer "
            "directory that names an eos_token)"
        )
    if args.append_eod and args.tokenizer_file and eod_id >= tok.vocab_size:
        raise ValueError(
            f"--eod-id {eod_id} is outside the vocabulary of {flag} {args.tokenizer_file} "
            f"({tok.vocab_size} ids)"
        )
    if args.prompt_key is not None:
        special_prefix(tok, spec)  # refuses a tokenizer that adds tokens after a text
    # Megatron's choice: DType.optimal_dtype(vocabulary size); a byte-level --eod-id beyond the
    # 257 ids widens the vocabulary.
    vocab = max(tok.vocab_size, eod_id + 1 if args.append_eod else 0)
    dtype = token_dtype(vocab)
    fmt = RecordFormat(
        keys=tuple(args.json_keys or [args.text_key or "text"]),
        prompt_key=args.prompt_key,
        response_key=args.response_key,
        eod_id=eod_id if args.append_eod else None,
        dtype=np.dtype(dtype).name,
        source=args.input,
        tokenizer=f"{flag} {args.tokenizer_file}",
    )
    with_mask = args.prompt_key is not None
    progress = tqdm(total=os.path.getsize(args.input), desc="tokenizing", unit="B", unit_scale=True)
    # One commit: tokens and mask are both written before any old file goes; a loss mask of the
    # old data never survives beside the new tokens (replaced by the new one, or removed when
    # none is written), and a crash leaves no old/new mix that would load.
    with progress:
        documents, tokens = jsonl_to_indexed(
            args.input,
            spec,
            fmt,
            outputs,
            dtype,
            mask_prefix=mask_prefix if with_mask else None,
            remove=[mask_prefix] if mask_prefix and not with_mask else [],
            workers=args.workers,
            tok=tok,
            progress=progress,
        )
    if args.overwrite and not args.json_keys:
        warn_unrewritten(args.output_prefix, [args.output_prefix, mask_prefix])
    for prefix, count in zip(outputs, tokens, strict=True):
        print(f"wrote {documents} documents, {count} tokens to {prefix}.bin/.idx")
    return 0


def warn_unrewritten(prefix: str, rewritten: list[str]) -> None:
    """Warns of other sidecars beside a rewritten prefix (they may describe the old data)."""
    others = sorted(
        set(glob.glob(glob.escape(prefix) + "?*.idx")) - {p + ".idx" for p in rewritten}
    )
    if others:
        print(
            f"warning: {', '.join(others)} beside the rewritten {prefix} were not rewritten and "
            "may no longer match it",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(run_tool(main))
