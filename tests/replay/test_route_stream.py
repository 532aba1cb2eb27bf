"""Tier: pure (numpy + files; one subprocess measures RSS and checks the module never imports
megatron).

Recording at scale: per-rank streams assembled into a route sidecar are byte-identical
to what the in-memory recorder wrote (naive reference below: per-document arrays, later packs and
later ranks overwrite, then ``write_route_sidecar``), pad rows are written as missing, peak memory
stays bounded while the recording is several times larger than the limit, and the read-side
validation keeps its temporaries within the input's size.
"""

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from megatron_ext.data.padding import real_positions
from megatron_ext.replay.route_dataset import write_route_sidecar
from megatron_ext.replay.route_file import first_invalid_row
from megatron_ext.replay.route_stream import (
    RouteStream,
    assemble_route_sidecar,
    remove_stream,
    stream_files,
)
from megatron_ext.replay.routes import missing_routes, route_dtype

FILES = (".bin", ".idx", ".routes.json")


def random_packs(rng, lengths, seq, num_packs):
    """Packs of random pieces: (pieces, routes_SLK, pad_mask_S), pieces may repeat across packs."""
    packs = []
    for _ in range(num_packs):
        doc_Q, start_Q, len_Q, used = [], [], [], 0
        while used < seq:
            d = int(rng.integers(len(lengths)))
            if lengths[d] == 0:
                continue
            start = int(rng.integers(lengths[d]))
            n = min(int(rng.integers(1, lengths[d] - start + 1)), seq - used)
            doc_Q.append(d), start_Q.append(start), len_Q.append(n)
            used += n
            if rng.random() < 0.3:
                break  # leaves pads at the end of the pack
        packs.append((np.array(doc_Q), np.array(start_Q), np.array(len_Q)))
    return packs


def _tokens_of(packs) -> set:
    """Every (document, token) a list of packs records."""
    return {
        (int(d), t)
        for (doc_Q, start_Q, len_Q), _, _ in packs
        for d, s, n in zip(doc_Q, start_Q, len_Q, strict=True)
        for t in range(int(s), int(s + n))
    }


def reference_sidecar(prefix, lengths, streams, num_layers, topk, num_experts):
    """Today's recorder: per-document buffers, add_pack in stream then recording order."""
    dtype = route_dtype(num_experts, topk)
    docs = [missing_routes(int(n), num_layers, topk, dtype) for n in lengths]
    for packs in streams:
        for (doc_Q, start_Q, len_Q), routes_SLK, pad_S in packs:
            rows = routes_SLK.copy()
            if pad_S is not None:
                rows[pad_S] = np.iinfo(dtype).max
            offset = 0
            for d, s, n in zip(doc_Q.tolist(), start_Q.tolist(), len_Q.tolist(), strict=True):
                docs[d][s : s + n] = rows[offset : offset + n]
                offset += n
    write_route_sidecar(prefix, docs, num_layers=num_layers, topk=topk, num_experts=num_experts)


@pytest.mark.parametrize("num_experts, topk", [(8, 2), (300, 3), (256, 1)])
def test_streams_assemble_byte_identical_to_the_in_memory_recorder(tmp_path, num_experts, topk):
    rng = np.random.default_rng(num_experts)
    layers, seq = 3, 24
    lengths = rng.integers(0, 40, size=30)  # empty documents included
    dtype = route_dtype(num_experts, topk)
    rank_packs = []
    for r in range(3):  # three data-parallel ranks
        packs = []
        for pieces in random_packs(rng, lengths, seq, 12):
            routes = rng.integers(0, num_experts, size=(seq, layers, topk)).astype(dtype)
            pad = rng.random(seq) < 0.2 if r == 1 else None  # "skip pads": rows recorded missing
            packs.append((pieces, routes, pad))
        rank_packs.append(packs)
    # The interesting cases occurred: one token recorded by two ranks, pads inside real rows.
    seen = [_tokens_of(packs) for packs in rank_packs]
    assert seen[0] & seen[1] and seen[1] & seen[2]
    streams = []
    for r, packs in enumerate(rank_packs):
        stream = RouteStream(str(tmp_path / f"out.dp{r}"), layers, topk, num_experts)
        for pieces, routes, pad in packs:
            stream.add_pack(pieces, routes, pad)
        stream.close()
        streams.append(stream.base)
    kwargs = dict(num_layers=layers, topk=topk, num_experts=num_experts)
    reference_sidecar(str(tmp_path / "ref"), lengths, rank_packs, layers, topk, num_experts)
    assert assemble_route_sidecar(str(tmp_path / "out"), streams, doc_lengths_D=lengths, **kwargs)
    # The same with byte pointers of an int32 token file (how RouteRecorder.for_dataset reads).
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 4
    assemble_route_sidecar(
        str(tmp_path / "ptr"), streams, doc_lengths_D=lengths.astype(np.int32),
        doc_offsets_D=pointers, offset_unit=4, **kwargs,
    )  # fmt: skip
    for ext in FILES:
        want = (tmp_path / f"ref{ext}").read_bytes()
        assert (tmp_path / f"out{ext}").read_bytes() == want, ext
        assert (tmp_path / f"ptr{ext}").read_bytes() == want, ext
    # Non-vacuous: some rows recorded, some missing (never recorded or pads).
    values = np.frombuffer((tmp_path / "out.bin").read_bytes(), dtype=dtype)
    assert (values == np.iinfo(dtype).max).any() and (values != np.iinfo(dtype).max).any()


def test_assembly_refuses_existing_outputs_missing_streams_and_bad_pieces(tmp_path):
    lengths = np.array([4, 3])
    kwargs = dict(doc_lengths_D=lengths, num_layers=1, topk=2, num_experts=8)
    stream = RouteStream(str(tmp_path / "s"), 1, 2, 8)
    stream.add_pack(
        (np.array([1]), np.array([0]), np.array([3])),
        np.tile(np.array([0, 1], dtype=np.uint8), (4, 1, 1)),
    )
    stream.close()
    assert assemble_route_sidecar(str(tmp_path / "o"), [stream.base], **kwargs) == 2
    with pytest.raises(ValueError, match=r"o\.bin already exists"):
        assemble_route_sidecar(str(tmp_path / "o"), [stream.base], **kwargs)
    assemble_route_sidecar(str(tmp_path / "o"), [stream.base], overwrite=True, **kwargs)
    with pytest.raises(ValueError, match="filesystem all ranks share"):
        assemble_route_sidecar(str(tmp_path / "p"), [str(tmp_path / "nope")], **kwargs)
    with pytest.raises(ValueError, match=r"piece \(document 1, start 0, length 3\) lies outside"):
        assemble_route_sidecar(
            str(tmp_path / "q"), [stream.base], **{**kwargs, "doc_lengths_D": np.array([4, 2])}
        )
    with open(stream_files(stream.base)[1], "r+b") as f:
        f.truncate(3)
    with pytest.raises(ValueError, match="ends early"):
        assemble_route_sidecar(str(tmp_path / "r"), [stream.base], **kwargs)
    assert not any(name.startswith((".q", ".r")) for name in os.listdir(tmp_path))  # no temps
    with pytest.raises(ValueError, match=r"holds 5 real tokens \(to position 4\) but 4 routes"):
        RouteStream(str(tmp_path / "t"), 1, 2, 8).add_pack(
            (np.array([0]), np.array([0]), np.array([5])), np.zeros((4, 1, 2), dtype=np.uint8)
        )
    remove_stream(stream.base)
    assert not any(os.path.exists(p) for p in stream_files(stream.base))


# A recording of LIMIT * 6 bytes of routes, recorded and assembled under LIMIT of peak memory.
LIMIT = 8 << 20
_RECORD_SCRIPT = r"""
import resource, sys, tracemalloc
import numpy as np
from megatron_ext.replay.route_stream import RouteStream, assemble_route_sidecar

root, limit, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
layers, topk, seq = 4, 4, 4096
lengths = np.full(limit * 6 // (layers * topk) // 600, 600)
total = int(lengths.sum()) * layers * topk
if mode == "trace":
    tracemalloc.start()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
stream = RouteStream(root + "/rec.dp0", layers, topk, 8)
rng = np.random.default_rng(0)
routes = rng.integers(0, 8, size=(seq, layers, topk)).astype(np.uint8)
doc, start = 0, 0
while doc < lengths.size:  # every token recorded once, in packs of seq positions
    pieces, used = [], 0
    while used < seq and doc < lengths.size:
        n = min(int(lengths[doc]) - start, seq - used)
        pieces.append((doc, start, n))
        used, start = used + n, start + n
        if start == lengths[doc]:
            doc, start = doc + 1, 0
    stream.add_pack(tuple(np.array(c) for c in zip(*pieces)), routes)
stream.close()
assemble_route_sidecar(root + "/rec", [stream.base], doc_lengths_D=lengths, num_layers=layers,
                       topk=topk, num_experts=8)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
peak = tracemalloc.get_traced_memory()[1] if mode == "trace" else 0
print(total, after - before, peak, any(m.split(".")[0] == "megatron" for m in sys.modules))
"""


@pytest.mark.parametrize("mode", ["rss", "trace"])
def test_recording_larger_than_the_memory_limit_stays_under_it(tmp_path, mode):
    out = subprocess.run(
        [sys.executable, "-c", _RECORD_SCRIPT, str(tmp_path), str(LIMIT), mode],
        check=True, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__)))),
    ).stdout.split()  # fmt: skip
    total, rss_growth, traced_peak, imported_megatron = (*map(int, out[:3]), out[3])
    assert total >= 5 * LIMIT  # the recording is several times the limit
    assert os.path.getsize(tmp_path / "rec.bin") == total
    assert imported_megatron == "False"  # the pure module never imports megatron
    if mode == "rss":  # the process's real high-water mark, beyond what it held before
        assert rss_growth < LIMIT, (rss_growth, total)
    else:  # every Python/numpy allocation, at its peak
        assert traced_peak < LIMIT // 2, (traced_peak, total)


def _old_first_invalid_row(routes_TLK, num_experts):
    """The whole-chunk version the read path used before (4.5-11x its input in temporaries)."""
    marker = int(np.iinfo(routes_TLK.dtype).max)
    is_marker = routes_TLK == marker
    missing = is_marker.all(-1)
    bad = [is_marker.any(-1) & ~missing, ((routes_TLK >= num_experts) & ~is_marker).any(-1)]
    s = np.sort(routes_TLK, axis=-1)
    bad.append((s[..., 1:] == s[..., :-1]).any(-1) & ~missing)
    return [int(np.flatnonzero(b)[0]) if b.any() else None for b in bad]


def _peak_over_input(fn, routes, *args):
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn(routes, *args)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return (routes.nbytes + peak) / routes.nbytes  # the input, plus what checking it added


@pytest.mark.parametrize("dtype, topk", [(np.uint8, 1), (np.uint8, 8), (np.uint16, 2)])
def test_read_validation_peak_is_at_most_twice_the_routes(dtype, topk):
    rng = np.random.default_rng(1)
    experts = 64
    routes = np.stack(
        [rng.permutation(experts)[:topk] for _ in range(4096 * 4)]
    ).astype(dtype).reshape(4096, 4, topk)  # fmt: skip
    routes[7] = np.iinfo(dtype).max  # a missing token: valid
    assert first_invalid_row(routes, experts) is None
    assert _peak_over_input(first_invalid_row, routes, experts) <= 2.0
    assert _peak_over_input(_old_first_invalid_row, routes, experts) > 2.5  # what it was


def test_blocked_validation_finds_the_same_first_row_as_a_row_loop():
    rng = np.random.default_rng(2)
    for trial in range(40):
        topk, experts = int(rng.integers(1, 4)), int(rng.choice([4, 255, 256]))
        dtype = route_dtype(experts, topk)
        routes = rng.integers(0, experts, size=(int(rng.integers(1, 300)), 2, topk))
        routes = routes.astype(dtype)
        marker = np.iinfo(dtype).max
        for _ in range(int(rng.integers(0, 4))):  # a few bad or missing rows
            t, layer, k = (int(rng.integers(n)) for n in routes.shape)
            routes[t, layer, k] = rng.choice([marker, min(experts, marker), routes[t, layer, 0]])
        routes[rng.random(routes.shape[0]) < 0.1] = marker
        want = None
        for t in range(routes.shape[0]):  # the rules, row by row
            for layer in range(routes.shape[1]):
                row = routes[t, layer].tolist()
                if all(v == marker for v in row):
                    continue
                if experts <= marker and marker in row:
                    want = (t, layer, "mixes the missing-row marker with real ids")
                elif any(v >= experts for v in row if v != marker or experts > marker):
                    want = (t, layer, f"has an expert id >= num_experts ({experts})")
                elif len(set(row)) < len(row):
                    want = (t, layer, "has duplicate expert ids in its top-k")
                if want:
                    break
            if want:
                break
        assert first_invalid_row(routes, experts) == want, trial


def test_a_context_parallel_pack_records_the_rows_of_its_real_positions(tmp_path):
    """Under CP every document sits in a slot padded to 2*CP: the rows recorded for a document are
    those at its real positions, never its pads' (same sidecar as the unpadded pack's)."""
    rng = np.random.default_rng(3)
    layers, topk, experts, cp = 2, 2, 8, 2
    lengths = np.array([3, 5, 2])
    pieces = (np.array([0, 1, 2]), np.zeros(3, np.int64), lengths)
    dtype = route_dtype(experts, topk)
    real_rows = rng.integers(0, experts, size=(lengths.sum(), layers, topk)).astype(dtype)
    padded = np.full((16, layers, topk), 7, dtype=dtype)  # slots 4 + 8 + 4; pads hold 7
    padded[real_positions(lengths, 2 * cp)] = real_rows
    kwargs = dict(num_layers=layers, topk=topk, num_experts=experts)
    for name, routes, multiple in (("plain", real_rows, 1), ("cp", padded, 2 * cp)):
        stream = RouteStream(str(tmp_path / f"{name}.dp0"), layers, topk, experts)
        stream.add_pack(pieces, routes, None, multiple)
        stream.close()
        assert assemble_route_sidecar(
            str(tmp_path / name), [stream.base], doc_lengths_D=lengths, **kwargs
        )
    for ext in FILES:
        assert (tmp_path / f"cp{ext}").read_bytes() == (tmp_path / f"plain{ext}").read_bytes()
    assert not (real_rows == 7).all()  # pads' rows would have changed the sidecar
