"""JSONL -> Megatron IndexedDataset (+ per-token loss-mask sidecar), tokenized locally.

    python tools/preprocess_data.py --input data.jsonl --output-prefix /data/sft \\
        --prompt-key prompt --response-key response --append-eod
    # -> /data/sft.bin/.idx and /data/sft_loss_mask.bin/.idx; train with
    #    --data-path /data/sft --pack-documents --pack-loss-mask-suffix _loss_mask
"""

import argparse
import os
import sys

import numpy as np
from tqdm import tqdm

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.jsonl_documents import (
    BYTE_EOD_ID,
    byte_tokenizer,
    hf_tokenizer,
    read_documents,
)


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
        help="local Hugging Face tokenizer.json; default: built-in byte-level (vocab 257)",
    )
    p.add_argument("--append-eod", action="store_true", help="end every document with --eod-id")
    p.add_argument("--eod-id", type=int, default=None, help=f"default {BYTE_EOD_ID} (byte-level)")
    p.add_argument(
        "--loss-mask-suffix",
        default="_loss_mask",
        help="sidecar PREFIX+SUFFIX written with --prompt-key (default: _loss_mask)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input} does not exist")
    if args.tokenizer_file is not None:
        if not os.path.isfile(args.tokenizer_file):
            raise ValueError(f"--tokenizer-file {args.tokenizer_file} does not exist")
        tokenize = hf_tokenizer(args.tokenizer_file)
        eod_id = args.eod_id
        if args.append_eod and eod_id is None:
            raise ValueError("--append-eod with --tokenizer-file needs --eod-id")
    else:
        tokenize, eod_id = (
            byte_tokenizer,
            BYTE_EOD_ID if args.eod_id is None else args.eod_id,
        )
    with open(args.input, encoding="utf-8") as f:
        total = sum(1 for _ in f)
    with open(args.input, encoding="utf-8") as f:
        docs = list(
            tqdm(
                read_documents(
                    f,
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
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    vocab_top = max((int(d[0].max()) for d in docs if d[0].size), default=0)
    dtype = np.uint16 if vocab_top < 2**16 else np.int32
    write_documents(args.output_prefix, (d[0] for d in tqdm(docs, desc="writing")), dtype=dtype)
    if args.prompt_key is not None:
        write_documents(
            args.output_prefix + args.loss_mask_suffix,
            (d[1] for d in docs),
            dtype=np.uint8,
        )
    num_tokens = sum(d[0].size for d in docs)
    print(f"wrote {len(docs)} documents, {num_tokens} tokens to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
