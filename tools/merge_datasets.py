"""Merges IndexedDataset shards into one, byte-identical to Megatron-LM's tools/merge_datasets.py.

    python tools/merge_datasets.py --input /data/shards --output-prefix /data/all
    # every PREFIX.bin/.idx pair in /data/shards, in name order -> /data/all.bin/.idx
    python tools/merge_datasets.py --input-prefixes /d/a /d/b --output-prefix /data/all

Shards are checked before anything is written: a pair with a missing half, a truncated .bin or an
.idx that does not describe it, shards of different dtypes (another tokenizer, a loss-mask
sidecar), or a shard named twice (also by a symlink or hard link) are refused in one line; an
empty shard adds nothing (as in Megatron's tool, wherever it falls in the order). The
output is written to temporary files and renamed at the end; an existing output is refused
unless --overwrite, and a shard never. Errors are one line, exit status 2; --debug shows the
traceback.
"""

import argparse
import sys

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import check_output_prefix
from megatron_ext.data.tool_errors import add_common_flags, run_tool


def build_parser() -> argparse.ArgumentParser:
    """The tool's arguments."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input", help="directory of shards: every .bin/.idx pair, in name order (Megatron's)"
    )
    source.add_argument("--input-prefixes", nargs="+", help="shard prefixes, in the order given")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx")
    add_common_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the merge; returns the process exit status."""
    args = build_parser().parse_args(argv)
    # Megatron's IndexedDataset (its package imports torch) only once the flags parsed.
    from megatron_ext.data.indexed_merge import merge_shards, shard_prefixes

    if args.input is not None:
        flag, prefixes = "--input", shard_prefixes(args.input)
    else:
        flag, prefixes = "--input-prefixes", args.input_prefixes
    check_output_prefix(
        args.output_prefix, flag="--output-prefix", inputs=prefixes, overwrite=args.overwrite
    )
    merge_shards(prefixes, args.output_prefix, flag)
    print(f"merged {len(prefixes)} shards into {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
