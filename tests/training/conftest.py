"""Shared data for the training tests: the embedded corpus preprocessed once by
tools/preprocess_data.py (the real loop), and the entry tests' ``data_prefix`` (providers,
argument checks, the examples' dry runs)."""

import subprocess
import sys

import numpy as np
import pytest

from tests.training.entry_args import EXPERTS, NUM_LAYERS, ROOT, TOPK


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


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    """Corpus documents as a token IndexedDataset plus an aligned route sidecar (random valid routes)."""
    from megatron_ext.training.corpus import corpus_documents
    from tests.data.dataset_helpers import write_documents_with_random_routes

    prefix = str(tmp_path_factory.mktemp("data") / "corpus_text_document")
    docs = [d[:90] for d in corpus_documents()[:80]]
    rng = np.random.default_rng(0)
    return write_documents_with_random_routes(
        prefix, docs, rng, num_layers=NUM_LAYERS, topk=TOPK, num_experts=EXPERTS
    )
