"""Shared pytest setup: keep Megatron's jit fusers from compiling on CPU and fix thread counts; fork
gloo workers from one preloaded server; give each test the session's environment back; the wheel
installed in a fresh venv and the demo run once from it (tests/installed_wheel.py), for every test
that reads them."""

import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ext.testing.distributed import fork_workers_from_server
from tests.training.entry_args import EXPERTS, NUM_LAYERS, ROOT, TOPK

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A pool rebuilt after a failure test, or fresh for a benchmark's allocator halves, then costs a
# fork, not seconds of imports per rank (tests/testing/test_distributed.py runs the spawn path).
fork_workers_from_server()


#: The environment the session started under (after the two defaults above).
SESSION_ENVIRONMENT = dict(os.environ)


def _restore_session_environment() -> None:
    for name in set(os.environ) - set(SESSION_ENVIRONMENT) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[name]
    for name, value in SESSION_ENVIRONMENT.items():
        if name != "PYTEST_CURRENT_TEST" and os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def session_environment():
    """Each test starts and ends under the session's environment. Entries run in this process set
    variables: Megatron's ``validate_args`` the ``NVTE_*_ATTN`` ones, ``--cpu``
    ``CUDA_DEVICE_MAX_CONNECTIONS``, a tokenizer directory ``HF_HUB_OFFLINE``; a module- or
    session-scoped fixture sets them before this fixture runs, so the session's own snapshot is put
    back, not the test's. ``launch`` forks ranks only under the environment its preloaded server
    started under (megatron_ext/rehearse/rank_server.py); one such leftover made every later launch
    of the session start fresh interpreters (seconds of imports per rank)."""
    _restore_session_environment()
    yield
    _restore_session_environment()


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """This checkout's wheel in a fresh venv (:func:`tests.installed_wheel.install_wheel`)."""
    from tests.installed_wheel import install_wheel

    return install_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def wheel_demo(installed, tmp_path_factory):
    """The demo as ``megatron-ext demo`` runs it from the installed wheel (one run per session)."""
    from tests.installed_wheel import run_demo

    return run_demo(installed, tmp_path_factory.mktemp("demo"))


# Shared data for the real-loop tests (training, cpu, rehearse): the embedded corpus preprocessed
# once by tools/preprocess_data.py, and the entry tests' ``data_prefix`` (providers, argument
# checks, the examples' dry runs).
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


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> tuple[str, str]:
    """``(tokenizer directory, JSONL)``: a real byte-level BPE for Megatron's ``SFTTokenizer`` built
    offline, and 200 lines of 1-3 conversations (megatron_ext/testing/sft_tokenizer.py)."""
    from megatron_ext.testing.sft_tokenizer import build_sft_tokenizer, write_conversations

    root = tmp_path_factory.mktemp("sft")
    tokenizer = build_sft_tokenizer(root / "tokenizer")
    return tokenizer, write_conversations(root / "chat.jsonl", num_lines=200, seed=1)
