"""Tests for megatron_ext.data.packed_dataset. Tier: Megatron on one rank (real IndexedDataset,
BlendedMegatronDatasetBuilder, BlendedDataset; no process group) plus one subprocess."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig, Sidecar
from megatron_ext.data.padding import IGNORE_INDEX, real_positions
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

SEQ = 32


def routes_of(tokens: np.ndarray) -> np.ndarray:
    """Synthetic per-token payload [N, 2] derived from the token, so padding can be checked."""
    return np.stack([tokens, tokens + 1], axis=1)


def write_corpus(prefix: str, seed: int, num_docs: int = 120, max_len: int = 45) -> list:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(1, max_len, size=num_docs)]
    write_documents(prefix, docs)
    write_documents(prefix + "_lm", [(d % 3 != 0) for d in docs], dtype=np.uint8)
    write_documents(prefix + "_routes", [routes_of(d) for d in docs], dtype=np.int16)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("packed")
    docs = {name: write_corpus(str(root / name), seed) for seed, name in enumerate("ab")}
    return {"root": str(root), "docs": docs}


def make_config(corpus: dict, **overrides) -> PackedDatasetConfig:
    kwargs = gpt_config_kwargs(
        [os.path.join(corpus["root"], "a")],
        sequence_length=SEQ,
        random_seed=7,
        split="80,10,10",
        path_to_cache=os.path.join(corpus["root"], "cache"),
        loss_mask_suffix="_lm",
        sidecars={"routes": Sidecar("_routes", width=2, fill=-1)},
        pad_to_seq_len=True,
    )
    kwargs.update(overrides)
    return PackedDatasetConfig(**kwargs)


def build(config: PackedDatasetConfig, sizes=(100, 10, 10)) -> list:
    return build_splits(PackedDataset, config, list(sizes))


def check_sample(ds: PackedDataset, docs: list, idx: int) -> int:
    """Checks one sample against the raw documents; returns its number of pads."""
    s = ds[idx]
    off = ds.plan["pack_offsets_P1"]
    q = slice(off[idx], off[idx + 1])
    pieces = zip(
        ds.plan["piece_doc_Q"][q],
        ds.plan["piece_start_Q"][q],
        ds.plan["piece_len_Q"][q],
        strict=True,
    )
    real = np.concatenate([docs[d][st : st + n] for d, st, n in pieces])
    n = real.size
    tokens = s["tokens"].numpy()
    assert np.array_equal(tokens[:n], real)
    assert not s["padding_mask"][:n].any() and s["padding_mask"][n:].all()
    # Loss mask: the label's sidecar bit, never on pads, never across a document boundary.
    lm = s["loss_mask"].numpy()
    assert not lm[n:].any() and set(np.unique(lm)) <= {0.0, 1.0}
    trained = lm > 0
    assert (s["labels"].numpy()[trained] % 3 != 0).all()
    untrained = s["labels"].numpy()[:n][~trained[:n]]
    assert ((untrained == IGNORE_INDEX) | (untrained % 3 == 0)).all()
    # The routes sidecar went through the same gather/pad path as the tokens.
    routes = s["routes"].numpy()
    copied = s["src_index"].numpy() >= 0
    assert np.array_equal(routes[copied], routes_of(tokens[copied]))
    assert (routes[~copied] == -1).all()
    assert s["cu_seqlens"].shape == (SEQ + 1,)
    assert int(s["cu_seqlens"][s["num_segments"]]) == tokens.size
    return int((~copied).sum() + s["padding_mask"].sum())


def test_samples_match_raw_documents_and_sidecars(corpus: dict) -> None:
    train, valid, test = build(make_config(corpus))
    assert isinstance(train, PackedDataset) and len(train) >= 100
    assert len(valid) >= 10 and len(test) >= 10
    pads = sum(check_sample(train, corpus["docs"]["a"], i) for i in range(len(train)))
    assert pads > 0  # the interesting case (padding) occurred
    assert train.stats["num_split"] > 0  # documents longer than SEQ were split, and counted


def test_blend_with_weights_and_splits(corpus: dict) -> None:
    prefixes = [os.path.join(corpus["root"], n) for n in "ab"]
    train, valid, _ = build(make_config(corpus, blend=(prefixes, [0.25, 0.75])), (200, 20, 20))
    assert isinstance(train, BlendedDataset) and len(train) == 200
    ids = np.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert 0.15 < (ids == 0).mean() < 0.35  # weights respected
    for i in range(0, 200, 17):
        sample = train[i]
        ds = train.datasets[int(sample["dataset_id"])]
        own = ds[int(train.dataset_sample_index[i])]
        assert sample["tokens"].shape == (SEQ,) and torch.equal(sample["tokens"], own["tokens"])
    assert all(isinstance(d, PackedDataset) for d in train.datasets)
    # Train and valid splits draw disjoint documents.
    tr_docs = set(train.datasets[0].plan["piece_doc_Q"].tolist())
    va_docs = set(valid.datasets[0].plan["piece_doc_Q"].tolist())
    assert tr_docs and va_docs and not tr_docs & va_docs


@pytest.mark.parametrize("algorithm", ["sequential", "best_fit"])
def test_pad_to_multiple_and_algorithms(corpus: dict, algorithm: str) -> None:
    cfg = make_config(
        corpus,
        pad_to_seq_len=False,
        pad_to_multiple_of=8,
        packing_algorithm=algorithm,
        path_to_cache=None,
    )
    train = build(cfg)[0]
    lengths = [train[i]["tokens"].numel() for i in range(len(train))]
    assert all(n % 8 == 0 and 0 < n <= SEQ for n in lengths) and len(set(lengths)) > 1
    for i in range(10):
        check_sample(train, corpus["docs"]["a"], i)


def test_overlong_policies_are_counted(corpus: dict) -> None:
    stats = {}
    for policy in ("split", "truncate", "drop"):
        ds = build(make_config(corpus, pack_overlong_policy=policy, path_to_cache=None))[0]
        stats[policy] = ds.stats
        assert max(int(ds.plan["piece_len_Q"].max()), 0) <= SEQ
    assert stats["split"]["num_split"] == stats["truncate"]["num_truncated"]
    assert stats["truncate"]["num_truncated"] == stats["drop"]["num_dropped"] > 0


def test_cache_is_reused_and_written_atomically(corpus: dict, tmp_path) -> None:
    cfg = make_config(corpus, path_to_cache=str(tmp_path))
    first = build(cfg)[0]
    files = os.listdir(tmp_path)
    assert not first.cache_hit and any(f.endswith("-packs.npz") for f in files)
    assert not any(f.endswith(".tmp") for f in files)
    second = build(cfg)[0]
    assert second.cache_hit
    for key in ("piece_doc_Q", "piece_start_Q", "piece_len_Q", "pack_offsets_P1"):
        assert np.array_equal(first.plan[key], second.plan[key])
    other = build(make_config(corpus, path_to_cache=str(tmp_path), packing_window=7))[0]
    assert not other.cache_hit  # everything that changes the plan is in the file name
    # A corrupt cache file is reported by name.
    path = first._cache_path()  # cfg's own train cache (two configs share the directory now)
    with open(path, "wb") as f:
        f.write(b"not a zip")
    with pytest.raises(ValueError, match=f"pack-index cache {path} is corrupt"):
        build(cfg)


def sample_digest(root: str, cache: str, seed: int) -> str:
    corpus = {"root": root}
    train = build(make_config(corpus, random_seed=seed, path_to_cache=cache))[0]
    h = hashlib.sha256()
    for i in range(len(train)):
        for key, value in sorted(train[i].items()):
            h.update(key.encode() + value.numpy().tobytes())
    return h.hexdigest()


def test_same_seed_same_packs_in_two_processes(corpus: dict, tmp_path) -> None:
    here = sample_digest(corpus["root"], str(tmp_path / "c1"), 7)
    code = (
        "from tests.data.test_packed_dataset import sample_digest;"
        f"print(sample_digest({corpus['root']!r}, {str(tmp_path / 'c2')!r}, 7))"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TORCHDYNAMO_DISABLE="1")
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == here
    assert sample_digest(corpus["root"], str(tmp_path / "c3"), 8) != here  # seed matters


def test_resume_from_sample_k_matches_fresh_run(corpus: dict) -> None:
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    train = build(make_config(corpus))[0]

    def loader(consumed: int):
        sampler = MegatronPretrainingSampler(len(train), consumed, 4, 0, 1)
        return iter(torch.utils.data.DataLoader(train, batch_sampler=sampler))

    fresh = loader(0)
    for _ in range(3):  # skip k = 12 samples
        next(fresh)
    resumed = loader(12)
    for _ in range(2):
        a, b = next(fresh), next(resumed)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_bad_inputs_name_the_problem(corpus: dict, tmp_path) -> None:
    root = corpus["root"]
    with pytest.raises(ValueError, match=r"--data-path file .*nope\.idx does not exist"):
        build(make_config(corpus, blend=([os.path.join(root, "nope")], None)))
    with pytest.raises(ValueError, match=r"loss-mask sidecar file .*a_missing\.idx does not"):
        build(make_config(corpus, loss_mask_suffix="_missing"))
    # Sidecar of the wrong width / length.
    with pytest.raises(
        ValueError, match=r"sidecar .*a_routes document 0 has \d+ values, expected 3"
    ):
        build(make_config(corpus, sidecars={"routes": Sidecar("_routes", width=3)}))
    short = str(tmp_path / "short")
    write_documents(short, [np.ones(3)])
    write_documents(short + "_lm", [np.ones(2)], dtype=np.uint8)
    with pytest.raises(ValueError, match=r"short_lm document 0 has 2 values, expected 1 x 3"):
        build(make_config(corpus, blend=([short], None), split="100,0,0"), (5, 0, 0))
    write_documents(short + "_few", [np.ones(3), np.ones(3)], dtype=np.uint8)
    with pytest.raises(ValueError, match=r"short_few has 2 documents, the tokens have 1"):
        build(make_config(corpus, blend=([short], None), split="100,0,0", loss_mask_suffix="_few"))
    corrupt = str(tmp_path / "corrupt")
    write_documents(corrupt, [np.ones(3)])
    with open(corrupt + ".idx", "wb") as f:
        f.write(b"garbage garbage garbage")
    with pytest.raises(ValueError, match=r"--data-path .*corrupt\.idx/\.bin is corrupt"):
        build(make_config(corpus, blend=([corrupt], None), loss_mask_suffix=None, sidecars={}))


def test_truncated_bin_is_refused_at_open_naming_the_file(corpus: dict, tmp_path) -> None:
    prefix = str(tmp_path / "cut")
    write_documents(prefix, [np.arange(1, 40), np.arange(1, 30)])
    config = make_config(
        corpus, blend=([prefix], None), split="100,0,0", loss_mask_suffix=None, sidecars={}
    )
    assert len(build(config, (4, 0, 0))[0]) >= 4  # the intact file builds
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(
        ValueError,
        match=rf"--data-path file .*cut\.bin has {size - 8} bytes but .*cut\.idx indexes {size}",
    ):
        build(config, (4, 0, 0))
    # The same check covers sidecars (here the routes sidecar grows by garbage).
    other = str(tmp_path / "grown")
    for ext in (".bin", ".idx"):
        for suffix in ("", "_lm", "_routes"):
            with open(os.path.join(corpus["root"], "a" + suffix + ext), "rb") as src:
                data = src.read()
            if suffix == "_routes" and ext == ".bin":
                data += b"\0\0"
            with open(other + suffix + ext, "wb") as dst:
                dst.write(data)
    with pytest.raises(ValueError, match=r"routes sidecar file .*grown_routes\.bin has"):
        build(make_config(corpus, blend=([other], None), split="100,0,0"), (4, 0, 0))


def test_sidecar_fill_must_fit_the_sidecar_dtype(corpus: dict, tmp_path) -> None:
    # uint8 routes with fill -1: refused when the dataset is built, naming the sidecar file.
    prefix = str(tmp_path / "u8")
    docs = [np.arange(1, 6), np.arange(1, 4)]
    write_documents(prefix, docs)
    write_documents(prefix + "_routes", [np.stack([d, d], 1) for d in docs], dtype=np.uint8)
    kw = {"blend": ([prefix], None), "split": "100,0,0", "loss_mask_suffix": None}
    kw["pad_policy"] = "constant"  # constant pads: the fill is what every pad row gets
    bad = make_config(corpus, sidecars={"routes": Sidecar("_routes", width=2, fill=-1)}, **kw)
    with pytest.raises(
        ValueError,
        match=r"sidecar 'routes' \(.*u8_routes\) holds uint8 values but its constant-pad fill is -1",
    ):
        build(bad, (2, 0, 0))
    good = make_config(corpus, sidecars={"routes": Sidecar("_routes", width=2, fill=255)}, **kw)
    sample = build(good, (2, 0, 0))[0][0]
    pads = sample["padding_mask"]
    assert pads.any() and (sample["routes"][pads] == 255).all()
    assert sample["routes"].dtype == torch.uint8


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"sequence_length": 0}, "--seq-length must be >= 1"),
        ({"blend": (["x", "y"], [1.0, -1.0])}, "--data-path weight -[12].0 for .* finite and > 0"),
        ({"blend": (["x", "y"], [0.0, 0.0])}, "--data-path weight 0.0 for"),
        ({"blend": (["x", "y"], [1.0, 0.0])}, "weight 0.0 for y .* leave the prefix out"),
        ({"pad_policy": "zeros"}, "unknown --pad-policy 'zeros'"),
        ({"packing_algorithm": "first_fit"}, "unknown --packing-algorithm"),
        ({"pack_overlong_policy": "wrap"}, "unknown --pack-overlong-policy"),
        ({"packing_window": 0}, "--packing-window must be >= 1"),
        (
            {"pad_to_seq_len": False, "pad_to_multiple_of": 5},
            "--seq-length=32 is not a multiple",
        ),
        (
            {"sidecars": {"routes": Sidecar("_r", width=0)}},
            "sidecar 'routes' width must be >= 1",
        ),
    ],
)
def test_bad_config_values(corpus: dict, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_config(corpus, **overrides)


def test_rewritten_data_at_the_same_prefix_never_reuses_the_old_plan(tmp_path) -> None:
    # An RL loop rewrites rollouts at one prefix and rebuilds with the same flags. The cache name
    # used to cover flags only: the new data reused the old plan (documents skipped, "documents"
    # spanning two real ones). The data's identity is now part of the key.
    prefix, cache = str(tmp_path / "rollouts"), str(tmp_path / "cache")
    config = make_config(
        {"root": str(tmp_path)},
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=cache,
        loss_mask_suffix=None,
        sidecars={},
        packing_algorithm="sequential",
    )
    rng = np.random.default_rng(0)
    for round_ in range(2):
        docs = [np.full(int(n), round_ + 1) for n in rng.integers(1, SEQ, size=30 + 30 * round_)]
        write_documents(prefix, docs)
        train = build(config, (10, 0, 0))[0]
        assert not train.cache_hit  # round 1 has a new identity: rebuilt, not reused
        assert set(train.plan["piece_doc_Q"].tolist()) == set(range(len(docs)))  # all trained
        ends = train.plan["piece_start_Q"] + train.plan["piece_len_Q"]
        assert (ends == np.array([d.size for d in docs])[train.plan["piece_doc_Q"]]).all()
        for i in range(len(train)):
            check_plain_sample(train, docs, i)
    assert len(os.listdir(cache)) == 2  # two plans, one per data identity


def check_plain_sample(ds: PackedDataset, docs: list, idx: int) -> None:
    off = ds.plan["pack_offsets_P1"]
    q = slice(off[idx], off[idx + 1])
    pieces = zip(
        *(ds.plan[k][q] for k in ("piece_doc_Q", "piece_start_Q", "piece_len_Q")), strict=True
    )
    real = np.concatenate([docs[d][st : st + n] for d, st, n in pieces])
    assert np.array_equal(ds[idx]["tokens"].numpy()[: real.size], real)
    bounds = ds[idx]["cu_seqlens"].numpy()[: int(ds[idx]["num_segments"]) + 1]
    piece_ends = np.cumsum(ds.plan["piece_len_Q"][q])
    assert set(piece_ends.tolist()) <= set(bounds.tolist())  # no segment spans two documents


def test_a_dataset_whose_documents_are_all_dropped_is_refused(tmp_path) -> None:
    prefix = str(tmp_path / "long")
    write_documents(prefix, [np.ones(SEQ + 5, np.int32), np.ones(SEQ + 1, np.int32)])
    config = make_config(
        {"root": str(tmp_path)},
        blend=([prefix], None),
        split="100,0,0",
        loss_mask_suffix=None,
        sidecars={},
        pack_overlong_policy="drop",
    )
    with pytest.raises(
        ValueError, match=r"none of the 2 documents of the train split fit a pack"
    ) as err:
        build(config, (4, 0, 0))
    # The counts are the split's, not an empty epoch's zeros.
    assert "(2 longer than --seq-length" in str(err.value) and "0 empty)" in str(err.value)


def test_loss_mask_values_other_than_0_1_are_refused_naming_document_and_token(tmp_path) -> None:
    prefix = str(tmp_path / "lm")
    write_documents(prefix, [np.arange(1, 5), np.arange(1, 4)])
    write_documents(prefix + "_lm", [np.ones(4), np.array([1, 2, 0])], dtype=np.uint8)
    config = make_config(
        {"root": str(tmp_path)}, blend=([prefix], None), split="100,0,0", sidecars={}
    )
    with pytest.raises(ValueError, match=r"lm_lm: document 1, token 1 holds 2; only \[0, 1\]"):
        build(config, (2, 0, 0))


def test_eod_mask_loss_masks_the_eod_inputs_as_megatron_does(tmp_path) -> None:
    """--eod-mask-loss was silently ignored by packs: no loss where the input token is the eod
    (Megatron's GPTDataset rule), the rest of the loss mask unchanged."""
    eod = 127  # the null tokenizer's eod: vocab_size - 1
    docs = [np.array([5, 6, eod, 7, 8, eod]), np.array([9, eod, 10, 11]), np.array([12, 13, 14])]
    prefix = str(tmp_path / "e")
    write_documents(prefix, docs)
    kw = gpt_config_kwargs([prefix], sequence_length=16, path_to_cache=str(tmp_path / "c"))
    plain = build_splits(PackedDataset, PackedDatasetConfig(**kw, pad_to_seq_len=True), [3, 0, 0])
    kw["eod_mask_loss"] = True
    masked = build_splits(PackedDataset, PackedDatasetConfig(**kw, pad_to_seq_len=True), [3, 0, 0])
    hits = 0
    for i in range(len(plain[0])):
        a, b = plain[0][i], masked[0][i]
        assert torch.equal(a["tokens"], b["tokens"])
        at_eod = a["tokens"] == eod
        hits += int((at_eod & (a["loss_mask"] > 0)).sum())  # trained on before: the case occurs
        assert (b["loss_mask"][at_eod] == 0).all()
        assert torch.equal(b["loss_mask"][~at_eod], a["loss_mask"][~at_eod])
    assert hits > 0


def test_a_resume_asking_for_more_samples_keeps_the_packs_order(corpus: dict) -> None:
    """More --train-iters (or another global batch) asks the builder for another sample count:
    the packs the first run consumed come in the same order (Megatron's GPTDataset index would
    reshuffle over the new epoch count)."""
    small = build(make_config(corpus), sizes=(100, 10, 10))[0]
    large = build(make_config(corpus), sizes=(700, 10, 10))[0]
    assert len(large) > len(small) >= 100  # the larger request spans more epochs of packs
    for i in range(100):
        a, b = small[i], large[i]
        assert all(torch.equal(a[k], b[k]) for k in a), i


def test_context_parallel_pads_every_document_and_plans_padded_lengths(corpus: dict) -> None:
    cp = 2
    cfg = make_config(corpus, doc_pad_multiple=2 * cp, pad_to_seq_len=False, pad_to_multiple_of=4)
    train = build(cfg)[0]
    docs = corpus["docs"]["a"]
    per_document_pads = 0
    for idx in range(len(train)):
        s = train[idx]
        doc_Q, start_Q, len_Q = train.pack_pieces(idx)
        real = real_positions(len_Q, 2 * cp)
        pieces = zip(doc_Q, start_Q, len_Q, strict=True)
        raw = np.concatenate([docs[d][st : st + n] for d, st, n in pieces])
        tokens = s["tokens"].numpy()
        assert tokens.size <= SEQ  # planning counted the padded lengths
        assert np.array_equal(tokens[real], raw) and not s["padding_mask"][real].any()
        bounds = s["cu_seqlens"][: int(s["num_segments"]) + 1].numpy()
        assert (bounds % (2 * cp) == 0).all() and bounds[-1] == tokens.size
        # The routes sidecar is padded by the same index: a pad carries its source's route.
        copied = s["src_index"].numpy() >= 0
        assert np.array_equal(s["routes"].numpy()[copied], routes_of(tokens[copied]))
        per_document_pads += int(s["padding_mask"][: real[-1] + 1].sum()) if real.size else 0
    assert per_document_pads > 0  # the interesting case: pads between documents
    # The plan is keyed by the multiple: CP 1 and CP 2 never share a cached plan.
    plain = build(make_config(corpus, pad_to_seq_len=False, pad_to_multiple_of=4))[0]
    assert plain.unique_description_hash != train.unique_description_hash
