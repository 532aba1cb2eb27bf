"""Generates the embedded demo corpus megatron_ext/assets/corpus.jsonl (deterministic, no download).

The text is produced by a small seeded grammar, so it is ours to ship (no licence questions) and
byte-identical on every machine. Documents have varied lengths, which is what packing and padding need.

    python tools/make_corpus.py --docs 600 --out megatron_ext/assets/corpus.jsonl
"""

import argparse
import json
import random

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


def main() -> None:
    """Writes the corpus."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=600, help="number of documents")
    parser.add_argument("--seed", type=int, default=2026, help="grammar seed")
    parser.add_argument("--out", default="megatron_ext/assets/corpus.jsonl", help="output jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.docs):
            f.write(json.dumps({"text": document(rng)}) + "\n")


if __name__ == "__main__":
    main()
