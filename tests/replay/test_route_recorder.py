"""Tier: Megatron on one rank (real IndexedDataset, RoutedPackedDataset) and gloo ranks (world 2,
data parallel 2, through ``run_state.record_routes`` / ``finish_recording``).

The streaming recorder writes, for the same recorded packs, exactly the bytes the in-memory
recorder wrote (reference: per-document arrays scattered in data-parallel rank order, then
``write_route_sidecar``), including a token recorded on both ranks (the later rank wins) and pad
rows recorded as missing (``pad_mask_BS``); rank 0 assembles, the streams are removed, and an
existing output is never replaced.
"""

import argparse
import os

import numpy as np
import pytest
import torch

from megatron_ext.testing import run_distributed

SEQ, LAYERS, TOPK, EXPERTS, BATCH = 32, 2, 2, 8, 2


def _dataset(root: str):
    from megatron_ext.replay.route_dataset import RoutedPackedDataset, RoutedPackedDatasetConfig
    from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

    kwargs = gpt_config_kwargs([f"{root}/docs"], sequence_length=SEQ, path_to_cache=f"{root}/cache")
    kwargs.update(
        pad_to_seq_len=True, route_suffix=None, route_num_layers=LAYERS, route_topk=TOPK,
        route_num_experts=EXPERTS,
    )  # fmt: skip
    return build_splits(RoutedPackedDataset, RoutedPackedDatasetConfig(**kwargs), [8, 0, 0])[0]


def _routes(seed: int) -> np.ndarray:
    """What a forward "chose" for a micro-batch: distinct top-2 per row, [B, S, L, K]."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, EXPERTS, size=(BATCH, SEQ, LAYERS))
    second = (first + rng.integers(1, EXPERTS, size=first.shape)) % EXPERTS
    return np.stack([first, second], axis=-1).astype(np.uint8)


def _reference(ds, prefix: str, recorded, moe_layer_ids=None) -> None:
    """Today's recorder: every rank's micro-batches, in rank order, scattered to documents."""
    from megatron_ext.replay.route_dataset import write_route_sidecar
    from megatron_ext.replay.routes import missing_routes

    lengths = ds.dataset.tokens.sequence_lengths
    docs = [missing_routes(int(n), LAYERS, TOPK, np.dtype(np.uint8)) for n in lengths]
    for packs, routes_BSLK, pads_BS in recorded:
        for b, pack in enumerate(packs):
            rows = routes_BSLK[b].copy()
            if pads_BS is not None:
                rows[pads_BS[b]] = 255
            offset = 0
            for d, s, n in zip(*(a.tolist() for a in ds.pack_pieces(pack)), strict=True):
                docs[d][s : s + n] = rows[offset : offset + n]
                offset += n
    write_route_sidecar(
        prefix, docs, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS,
        tokens_prefix=ds.dataset.tokens.path_prefix,  # the recorder names the tokens it recorded on
        moe_layer_ids=moe_layer_ids,
    )  # fmt: skip


#: Micro-batches per data-parallel rank: (pack indices, routes seed, pads inside real tokens).
#: Packs 0 and 2 are recorded on both ranks (a second epoch); rank 1's later recording wins.
PLAN = {0: [([0, 1], 10, False), ([2, 3], 11, False)], 1: [([2, 4], 20, True), ([5, 0], 21, False)]}


class _StubBinding:
    """``recorded_routes(key)`` of a record-mode binding: the planned routes of micro-batch key."""

    def __init__(self, routes: dict) -> None:
        self.routes = routes

    def recorded_routes(self, key) -> torch.Tensor:
        return torch.from_numpy(self.routes[key])


def _record_on_ranks(root: str) -> dict:
    from megatron_ext.training import run_state
    from megatron_ext.training.feature_configs import ReplayConfig

    rank = torch.distributed.get_rank()
    ds = _dataset(root)
    args = argparse.Namespace(num_layers=LAYERS, moe_layer_freq=1, num_experts=EXPERTS)
    run_state.reset()
    config = ReplayConfig(route_replay_mode="record", route_record_path=f"{root}/rec")
    run_state._STATE = run_state.RunState(args_id=id(args), configs={ReplayConfig: config})
    run_state.state(args).record_dataset = ds
    binding = _StubBinding({key: _routes(seed) for key, (_, seed, _) in enumerate(PLAN[rank])})
    recorded = []
    for key, (packs, _, inner_pads) in enumerate(PLAN[rank]):
        pads_BS = torch.stack([ds[p]["padding_mask"] for p in packs])
        if inner_pads:
            pads_BS[:, 3] = True  # a "skip pads" pad inside the real tokens: recorded missing
        pack_index = torch.tensor(packs)
        run_state.record_routes(args, binding, key, pack_index, (BATCH, SEQ), pad_mask_BS=pads_BS)
        recorded.append((packs, binding.routes[key], pads_BS.numpy()))
    streams_while_recording = sorted(f for f in os.listdir(root) if ".dp" in f)
    written = run_state.finish_recording(args)
    try:
        run_state.finish_recording(args)  # a second write never replaces the recording
        refused = None
    except ValueError as exc:
        refused = str(exc)
    run_state.reset()
    return {
        "written": written,
        "recorded": recorded,
        "streams": streams_while_recording,
        "refused": refused,
    }


def test_data_parallel_recording_is_byte_identical_to_the_gathered_one(tmp_path):
    from megatron_ext.data.indexed_writer import write_documents

    rng = np.random.default_rng(4)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(3, 40, size=20)]
    write_documents(str(tmp_path / "docs"), docs)
    ds = _dataset(str(tmp_path))  # builds the pack cache once, before the ranks read it
    results = run_distributed(_record_on_ranks, 2, str(tmp_path))
    assert results[0]["written"] == len(docs) and results[1]["written"] is None
    for r in (0, 1):  # each data-parallel rank streamed to its own files while recording
        assert {f"rec.dp{r}.pieces", f"rec.dp{r}.rows"} <= set(results[r]["streams"])
    assert not any(".dp" in f for f in os.listdir(tmp_path))  # streams removed after assembly
    assert "rec.bin already exists" in results[0]["refused"]
    recorded = results[0]["recorded"] + results[1]["recorded"]
    _reference(ds, str(tmp_path / "ref"), recorded, moe_layer_ids=list(range(LAYERS)))
    for ext in (".bin", ".idx", ".routes.json"):
        assert (tmp_path / f"rec{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    # The interesting cases occurred: pads inside real tokens written missing, a token recorded
    # by both ranks holding rank 1's route, and rank 0's recording in other documents kept.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    rec = IndexedDataset(str(tmp_path / "rec"))

    def row(pack: int, position: int) -> np.ndarray:  # the sidecar row of a pack position
        doc_Q, start_Q, len_Q = ds.pack_pieces(pack)
        q = int(np.searchsorted(np.cumsum(len_Q), position, side="right"))
        token = int(start_Q[q]) + position - int(np.cumsum(len_Q)[q] - len_Q[q])
        return rec[int(doc_Q[q])].reshape(-1, LAYERS, TOPK)[token]

    assert np.array_equal(row(2, 0), _routes(20)[0, 0])  # rank 1's, recorded after rank 0's
    assert not np.array_equal(_routes(20)[0, 0], _routes(11)[0, 0])
    assert np.array_equal(row(1, 0), _routes(10)[1, 0])  # rank 0's own packs kept
    assert (row(4, 3) == 255).all() and (row(2, 3) == 255).all()  # pads inside real tokens
    assert int(ds.pack_pieces(4)[2].sum()) > 3


def test_recorder_for_dataset_matches_the_in_memory_one(tmp_path):
    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_recorder import RouteRecorder

    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(3, 40, size=20)]
    write_documents(str(tmp_path / "docs"), docs)
    ds = _dataset(str(tmp_path))
    recorder = RouteRecorder.for_dataset(ds)
    assert recorder.doc_offsets is not None  # read from the token index, not a copy
    recorded = []
    for key in range(len(ds) // BATCH):
        packs = list(range(key * BATCH, (key + 1) * BATCH))
        routes = _routes(key)
        for b, pack in enumerate(packs):
            recorder.add_pack(ds.pack_pieces(pack), routes[b])
        recorded.append((packs, routes, None))
    assert recorder.write(str(tmp_path / "rec")) == len(docs)
    _reference(ds, str(tmp_path / "ref"), recorded)
    for ext in (".bin", ".idx", ".routes.json"):
        assert (tmp_path / f"rec{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    stream = recorder.base
    recorder.close()
    assert not os.path.exists(stream + ".rows")  # its temporary stream is gone
    with pytest.raises(ValueError, match="expected uint8"):
        RouteRecorder.for_dataset(ds).add_pack(ds.pack_pieces(0), _routes(0)[0].astype(np.int64))


def test_tokens_rewritten_while_recording_are_refused_at_write(tmp_path):
    """The header's tokens_digest must describe the tokens the routes were recorded on: tokens
    rewritten (same lengths) between the first pack and write() are refused, nothing written."""
    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_recorder import RouteRecorder

    rng = np.random.default_rng(6)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(3, 40, size=20)]
    write_documents(str(tmp_path / "docs"), docs)
    ds = _dataset(str(tmp_path))
    recorder = RouteRecorder.for_dataset(ds)
    assert recorder.tokens_prefix == str(tmp_path / "docs")
    recorder.add_pack(ds.pack_pieces(0), _routes(0)[0])
    write_documents(str(tmp_path / "docs"), [d + 1 for d in docs])  # same lengths
    with pytest.raises(ValueError, match="was rewritten while its routes were being recorded"):
        recorder.write(str(tmp_path / "rec"))
    assert not os.path.exists(tmp_path / "rec.idx")
    recorder.close()


def test_recorded_header_names_the_moe_layers_and_a_mismatched_list_is_refused(tmp_path):
    """The recording model's MoE layers go into the header; a replay maps them onto its own MoE
    layers in order (``check_layer_ids``), and refuses another count of them at argument time."""
    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_file import check_layer_ids, read_header
    from megatron_ext.replay.route_recorder import RouteRecorder

    write_documents(str(tmp_path / "docs"), [np.arange(1, 9), np.arange(1, 30)])
    ds = _dataset(str(tmp_path))
    with pytest.raises(ValueError, match=r"3 MoE layer ids \[0, 1, 2\] for 2 recorded layers"):
        RouteRecorder.for_dataset(ds, moe_layer_ids=[0, 1, 2])
    recorder = RouteRecorder.for_dataset(ds, moe_layer_ids=[1, 3])
    recorder.add_pack(ds.pack_pieces(0), _routes(0)[0])
    recorder.write(str(tmp_path / "rec"))
    recorder.close()
    header = read_header(str(tmp_path / "rec.routes.json"))
    assert header["moe_layer_ids"] == [1, 3]
    check_layer_ids(header, "rec.routes.json", [1, 3])
    check_layer_ids(header, "rec.routes.json", [0, 1])  # numbered otherwise: mapped in order
    with pytest.raises(ValueError, match=r"rec.routes.json holds the routes of 2 MoE layers .* "
                       r"the model has 3 MoE layers \(0-2"):  # fmt: skip
        check_layer_ids(header, "rec.routes.json", [0, 1, 2])
