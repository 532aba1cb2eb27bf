"""Generates the embedded demo corpus megatron_ext/assets/corpus.jsonl (deterministic, no download).

The text is produced by a small seeded grammar, so it is ours to ship (no licence questions) and
byte-identical on every machine. Documents have varied lengths, which is what packing and padding need.

    python tools/make_corpus.py --docs 600 --out megatron_ext/assets/corpus.jsonl --overwrite

The file is written through a temporary file and a rename; an existing --out is refused unless
--overwrite. Errors are one line, exit status 2.
"""

import argparse
import json
import random
import sys

import megatron_ext.cli.quiet_tools  # noqa: F401  (first: hides inapplicable warnings unless --verbose)
from megatron_ext.common.safe_files import atomic_write_bytes, check_output_file
from megatron_ext.data.tool_errors import add_common_flags, run_tool

SUBJECTS = [
    "the router",
    "a small expert",
    "the old miller",
    "every token",
    "the river",
    "a patient teacher",
    "the gradient",
    "our neighbour",
    "the night train",
    "a careful reader",
    "the harbour master",
    "the second layer",
    "a young gardener",
    "the compiler",
    "the cold wind",
    "a stubborn clock",
]
VERBS = [
    "carries",
    "remembers",
    "divides",
    "follows",
    "measures",
    "forgets",
    "returns",
    "gathers",
    "balances",
    "watches",
    "repairs",
    "counts",
    "sends",
    "borrows",
    "paints",
    "answers",
]
OBJECTS = [
    "the heavy letters",
    "a quiet field",
    "seven lanterns",
    "the morning bread",
    "its own shadow",
    "the rows of numbers",
    "a bright blue kite",
    "the broken fence",
    "every question",
    "the tide",
    "a map of the valley",
    "two silver keys",
    "the last page",
    "the evening bells",
    "a long road",
]
TAILS = [
    "before the rain",
    "without a word",
    "as the sun rises",
    "for the third time",
    "in the market",
    "while the others sleep",
    "near the old bridge",
    "with great care",
    "after the storm",
    "on a winter morning",
    "beyond the hills",
    "under the lamp",
    "at the end of the day",
]
OPENERS = ["Then", "Later", "Still", "Meanwhile", "At last", "Once again", "Soon", "Quietly"]


def sentence(rng: random.Random) -> str:
    """One sentence from the grammar."""
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.6:
        words.append(rng.choice(TAILS))
    text = " ".join(words)
    if rng.random() < 0.3:
        text = rng.choice(OPENERS) + " " + text
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def document(rng: random.Random) -> str:
    """A document of 1 to 40 sentences (long-tailed, like real corpora)."""
    return " ".join(sentence(rng) for _ in range(min(40, 1 + int(rng.expovariate(1 / 8)))))


def main(argv: list[str] | None = None) -> int:
    """Writes the corpus; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=600, help="number of documents (>= 1)")
    parser.add_argument("--seed", type=int, default=2026, help="grammar seed")
    parser.add_argument("--out", default="megatron_ext/assets/corpus.jsonl", help="output jsonl")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    if args.docs < 1:
        raise ValueError(f"--docs must be >= 1, got {args.docs}")
    check_output_file(args.out, flag="--out", overwrite=args.overwrite)
    rng = random.Random(args.seed)
    lines = "".join(json.dumps({"text": document(rng)}) + "\n" for _ in range(args.docs))
    atomic_write_bytes(args.out, lines.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
