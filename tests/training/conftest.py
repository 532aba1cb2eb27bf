"""Shared data for the real-loop tests: the embedded corpus preprocessed once by tools/preprocess_data.py."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """``PREFIX.bin/.idx`` of the embedded corpus, byte-level tokens with end-of-document id 256."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "corpus_text_document")
    subprocess.run(
        [
            sys.executable, str(ROOT / "tools/preprocess_data.py"),
            "--input", str(ROOT / "megatron_ext/assets/corpus.jsonl"),
            "--output-prefix", prefix, "--append-eod",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return prefix
