"""Tier: Megatron's real training loop (2 gloo ranks with torchrun's environment, CPU): checkpoint and resume.

An uninterrupted run saves at iteration K and at N (``--save-interval K``; saving does not change its
training), so it is also the reference. A second run loads the iteration-K checkpoint (``--load
--ckpt-step K``), trains K+1..N and saves at N. With dropout on, the resumed iterations log what the
uninterrupted run logged, and the two iteration-N checkpoints are bit-for-bit equal: weights, Adam
moments, the RNG states (Python, numpy, CPU, the tracker's), the LR scheduler. The samples resume with
Megatron's consumed-samples counter: self-padded ``GPTDataset`` rows, and packs (whole documents, pads to
``--seq-length``) with their replayed route rows.

Formats on gloo/CPU: ``torch`` and ``torch_dist`` (sync save, default load) both resume exactly.
``torch_dist`` saves need ``psutil`` (Megatron's ``filesystem_async`` measures its writer's memory with
it); ``--ckpt-fully-parallel-load`` (``exchange_utils`` calls ``.cuda()``) and ``--async-save`` (needs
``nvidia-resiliency-ext``) do not run on CPU.
"""

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, LoopRun, launch

K, N = 3, 6  # save at K, resume, train to N
GLOBAL_BATCH = 8  # TINY_MOE_TEST_ARGS' --global-batch-size
NUM_LAYERS, TOPK, EXPERTS = 2, 2, 8  # TINY_MOE_TEST_ARGS' MoE layers, top-k, experts
DROPOUT = ("--attention-dropout", "0.1", "--hidden-dropout", "0.1")
#: Per-iteration fields of Megatron's log line that a resumed run must reproduce.
LOGGED = ("learning rate", "lm loss", "load_balancing_loss", "grad norm")
_CONSUMED = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|")


@pytest.fixture(scope="module")
def routed_prefix(tmp_path_factory) -> str:
    """Corpus documents of 43..63 tokens with a route sidecar (random valid top-2 of 8, header
    included). Packed to 128 with ``--pad-to-seq-len``, every pack holds one or two documents
    (3 x 43 > 128) and at least 2 pads (2 x 63 = 126), so every row has pads and pad routes."""
    from megatron_ext.training.corpus import corpus_documents
    from tests.data.dataset_helpers import write_documents_with_random_routes

    rng = np.random.default_rng(0)
    long_docs = [d for d in corpus_documents() if d.size >= 63][:160]
    docs = [d[: int(rng.integers(43, 64))] for d in long_docs]
    prefix = str(tmp_path_factory.mktemp("routed") / "docs")
    return write_documents_with_random_routes(
        prefix, docs, rng, num_layers=NUM_LAYERS, topk=TOPK, num_experts=EXPERTS
    )


def _uninterrupted_and_resumed(args: list[str], root: Path) -> tuple[LoopRun, LoopRun]:
    """The reference run (saves at K and N into ``root/a``) and the run resumed from its iteration K
    (saves at N into ``root/b``)."""
    common = [
        *TINY_MOE_TEST_ARGS,
        *DROPOUT,
        *args,
        "--train-iters",
        str(N),
        "--save-interval",
        str(K),
    ]
    reference = launch([*common, "--save", str(root / "a")]).check()
    resumed = launch(
        [*common, "--load", str(root / "a"), "--ckpt-step", str(K), "--save", str(root / "b")]
    ).check()
    return reference, resumed


def _assert_same_log(reference: LoopRun, resumed: LoopRun) -> None:
    """Iterations K+1..N log what the uninterrupted run logged (printed to 7 significant digits)."""
    loaded = resumed.argv[resumed.argv.index("--load") + 1]
    assert f"checkpoint from {loaded} at iteration {K}" in resumed.output
    assert sorted(reference.iterations) == list(range(1, N + 1))
    assert sorted(resumed.iterations) == list(range(K + 1, N + 1))
    consumed = {int(i): int(c) for i, c in _CONSUMED.findall(resumed.output)}
    assert consumed == {i: i * GLOBAL_BATCH for i in range(K + 1, N + 1)}
    for i in range(K + 1, N + 1):
        ref, res = reference.iterations[i], resumed.iterations[i]
        for key in LOGGED:  # each line its own iteration's (megatron_ext.training.loss_log)
            assert res[key] == ref[key], (i, key)
    # Not vacuous: the model trains, so a run that lost its place would log other losses.
    assert len({reference.losses[i] for i in range(K + 1, N + 1)}) == N - K


def _leaves(obj: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a nested checkpoint dict, by path; ``args`` (paths of the run) left out."""
    if isinstance(obj, dict):
        items = [(str(k), v) for k, v in obj.items() if k != "args"]
    elif isinstance(obj, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return {path: obj}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_leaves(value, f"{path}/{key}"))
    return out


def _checkpoint(iter_dir: Path, ckpt_format: str, scratch: Path) -> dict[str, Any]:
    """All ranks' state of one saved iteration, read back with torch alone."""
    if ckpt_format == "torch":
        files = sorted(iter_dir.glob("mp_rank_*/model_optim_rng.pt"))
        assert len(files) == 2, files  # one per EP rank
        state = {
            f.parent.name: torch.load(f, map_location="cpu", weights_only=False) for f in files
        }
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with warnings.catch_warnings():  # "no process group: loading in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_to_torch_save(iter_dir, scratch)
        state = torch.load(scratch, map_location="cpu", weights_only=False)
    return _leaves(state)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def _assert_same_checkpoint(root: Path, ckpt_format: str) -> None:
    """The resumed run's iteration-N checkpoint equals the uninterrupted run's, bit for bit."""
    step = f"iter_{N:07d}"
    ref = _checkpoint(root / "a" / step, ckpt_format, root / "ref.pt")
    res = _checkpoint(root / "b" / step, ckpt_format, root / "res.pt")
    assert ref.keys() == res.keys()
    assert [k for k in ref if not _equal(ref[k], res[k])] == []
    tensors = [k for k, v in ref.items() if isinstance(v, torch.Tensor)]
    for part in ("word_embeddings.weight", "exp_avg_sq", "torch_rng_state", "rng_tracker_states"):
        assert any(part in k for k in ref), part  # weights, Adam moments, RNG states are compared
    # Not vacuous: iterations K+1..N changed the weights the comparison covers.
    at_k = _checkpoint(root / "a" / f"iter_{K:07d}", ckpt_format, root / "k.pt")
    assert sum(not _equal(at_k[k], ref[k]) for k in tensors if "weight" in k) > 20


def test_resume_packed_documents_with_replayed_routes_torch_format(routed_prefix, tmp_path) -> None:
    """``torch`` format; packs, their pads and their route rows resume at consumed samples K x B."""
    args = [
        "--data-path", routed_prefix, "--pack-documents", "--pad-to-seq-len",
        "--route-replay-mode", "replay", "--route-data-suffix", "_routes", "--ckpt-format", "torch",
    ]  # fmt: skip
    reference, resumed = _uninterrupted_and_resumed(args, tmp_path)
    assert "building RoutedPackedDataset" in resumed.output
    _assert_same_log(reference, resumed)
    _assert_same_checkpoint(tmp_path, "torch")


@pytest.mark.each_megatron
def test_resume_self_padded_gpt_dataset_torch_dist_format(corpus_prefix, tmp_path) -> None:
    """``torch_dist`` format (sync, fully parallel save); the default self-padded ``GPTDataset``."""
    args = ["--data-path", corpus_prefix, "--ckpt-format", "torch_dist"]
    reference, resumed = _uninterrupted_and_resumed(args, tmp_path)
    assert "building SelfPaddedGPTDataset" in resumed.output
    _assert_same_log(reference, resumed)
    _assert_same_checkpoint(tmp_path, "torch_dist")


def test_record_mode_refuses_to_resume_and_records_from_a_finetune_load(
    routed_prefix, tmp_path
) -> None:
    """Record mode streams what this run's forwards chose: resumed at iteration K, the documents
    of iterations 1..K would end missing without a word, so resuming is refused; --finetune (the
    weights, iteration 0) records every iteration."""
    args = [
        *TINY_MOE_TEST_ARGS, "--data-path", routed_prefix, "--pack-documents", "--pad-to-seq-len",
        "--ckpt-format", "torch", "--train-iters", "2",
    ]  # fmt: skip
    record = ["--route-replay-mode", "record"]
    launch([*args, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]).check()
    resumed = launch(
        [*args, *record, "--route-record-path", str(tmp_path / "r1"), "--load",
         str(tmp_path / "ckpt"), "--ckpt-step", "1"]
    )  # fmt: skip
    assert resumed.returncode != 0
    assert "record cannot resume from the checkpoint at iteration 1" in resumed.output
    assert not list(tmp_path.glob("r1*"))  # nothing recorded, no stream left behind
    finetuned = launch(
        [*args, *record, "--route-record-path", str(tmp_path / "r2"), "--load",
         str(tmp_path / "ckpt"), "--finetune"]
    ).check()  # fmt: skip
    assert sorted(p.name for p in tmp_path.glob("r2*")) == ["r2.bin", "r2.idx", "r2.routes.json"]
    assert 1 in finetuned.losses


@pytest.mark.parametrize(
    "data",
    [["--pack-documents", "--pad-to-seq-len"], []],
    ids=["packed", "self-padded"],
)
def test_continue_to_more_iterations_with_this_runs_schedule(data, corpus_prefix, tmp_path) -> None:
    """ "Train K, then continue to N": the changed --train-iters is refused without a word on the
    schedule (tests/training/test_startup_refusals.py); with --override-opt_param-scheduler the
    continued run follows this run's schedule from iteration K. At a constant LR (the schedule up
    to K is the same either way) it writes the iteration-N checkpoint of an uninterrupted
    N-iteration run bit for bit: a pack plan does not depend on the sample count, and Megatron's
    GPTDataset index does not while the samples asked for fit one epoch (N x 8 samples of the
    corpus's ~2100)."""
    common = [*TINY_MOE_TEST_ARGS, "--data-path", corpus_prefix, *data, "--ckpt-format", "torch"]
    first = ["--train-iters", str(K), "--save-interval", str(K), "--save", str(tmp_path / "k")]
    launch([*common, *first]).check()
    resumed = launch(
        [*common, "--train-iters", str(N), "--save-interval", str(N), "--load",
         str(tmp_path / "k"), "--save", str(tmp_path / "b"), "--override-opt_param-scheduler"]
    ).check()  # fmt: skip
    reference = ["--train-iters", str(N), "--save-interval", str(N), "--save", str(tmp_path / "a")]
    launch([*common, *reference]).check()
    assert f"iteration {K}): --train-iters {K} -> {N} (the checkpoint's -> this run's)" in (
        resumed.output
    )
    assert sorted(resumed.iterations) == list(range(K + 1, N + 1))
    step = f"iter_{N:07d}"
    ref = _checkpoint(tmp_path / "a" / step, "torch", tmp_path / "ref.pt")
    res = _checkpoint(tmp_path / "b" / step, "torch", tmp_path / "res.pt")
    assert ref.keys() == res.keys()
    assert [k for k in ref if not _equal(ref[k], res[k])] == []
    assert any("exp_avg_sq" in k for k in ref)  # Adam moments are compared
    # Not vacuous: iterations K+1..N changed the weights the comparison covers.
    at_k = _checkpoint(tmp_path / "k" / f"iter_{K:07d}", "torch", tmp_path / "k.pt")
    assert sum(not _equal(at_k[k], ref[k]) for k in ref if k.endswith("weight")) > 20
