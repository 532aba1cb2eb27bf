"""Tier: Megatron on one rank (real IndexedDataset, BlendedMegatronDatasetBuilder, pack cache).

Routes ride the data blender's sidecar hook: packed, split and self-padded by the tokens' own code
path, validated once when the dataset is built (header L/K/E, every row), missing rows handled by
the policy, and recorded routes written back document-aligned with their header.
"""

import os

import numpy as np
import pytest
from megatron.core.datasets.blended_dataset import BlendedDataset

from megatron_ext.common.safe_files import file_identity
from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.route_dataset import (
    RoutedPackedDataset,
    RoutedPackedDatasetConfig,
    RouteRecorder,
    write_route_sidecar,
)
from megatron_ext.replay.routes import (
    fill_missing_balanced,
    missing_mask,
    rank_counts,
    validate_routes,
)
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

SEQ, LAYERS, TOPK, EXPERTS = 32, 2, 2, 8


def route_of(tokens: np.ndarray) -> np.ndarray:
    """Routes derived from the token id, so any position's route can be checked: [T, L, K]."""
    layer = np.arange(LAYERS)[None, :, None]
    slot = np.arange(TOPK)[None, None, :]
    return ((tokens[:, None, None] + layer + slot) % EXPERTS).astype(np.uint8)


def doc_routes(doc: np.ndarray) -> np.ndarray:
    """vLLM-like: the last token has no route (missing marker)."""
    routes = route_of(doc)
    routes[-1] = 255
    return routes


def write_corpus(prefix: str, seed: int, num_docs: int = 80) -> list:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(2, 45, size=num_docs)]
    write_documents(prefix, docs)
    write_routes(prefix + "_routes", [doc_routes(d) for d in docs])
    return docs


def write_routes(prefix: str, routes: list, overwrite: bool = True) -> None:
    write_route_sidecar(
        prefix, routes, num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS, overwrite=overwrite
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("routed")
    docs = {name: write_corpus(str(root / name), seed) for seed, name in enumerate("ab")}
    return {"root": str(root), "docs": docs}


def make_config(corpus: dict, **overrides) -> RoutedPackedDatasetConfig:
    kwargs = gpt_config_kwargs(
        [os.path.join(corpus["root"], "a")],
        sequence_length=SEQ,
        random_seed=3,
        path_to_cache=os.path.join(corpus["root"], "cache"),
    )
    kwargs.update(
        pad_to_seq_len=True, route_num_layers=LAYERS, route_topk=TOPK, route_num_experts=EXPERTS
    )
    kwargs.update(overrides)
    return RoutedPackedDatasetConfig(**kwargs)


def build(config: RoutedPackedDatasetConfig, size: int = 60):
    return build_splits(RoutedPackedDataset, config, [size, 0, 0])[0]


def test_pads_replay_the_routes_of_the_tokens_they_copy(corpus):
    ds = build(make_config(corpus))
    pads_seen = 0
    for i in range(len(ds)):
        s = ds[i]
        tokens, routes, src = s["tokens"].numpy(), s["routes"].numpy(), s["src_index"].numpy()
        assert routes.shape == (SEQ, LAYERS, TOPK) and routes.dtype == np.uint8
        doc_Q, start_Q, len_Q = ds.pack_pieces(i)
        # Real positions: the document's routes (last token of a document missing); pads: the
        # routes of the real position they copy.
        real = np.concatenate(
            [
                doc_routes(corpus["docs"]["a"][d])[st : st + n]
                for d, st, n in zip(doc_Q, start_Q, len_Q, strict=True)
            ]
        )
        n = real.shape[0]
        assert np.array_equal(routes[:n], real)
        assert np.array_equal(routes[n:], real[src[n:]])
        pads_seen += SEQ - n
        has_route = ~missing_mask(routes)[:, 0]  # every route belongs to the token at its position
        assert np.array_equal(routes[has_route], route_of(tokens)[has_route])
        assert int(s["pack_index"]) == i
    assert pads_seen > 0


def test_balanced_policy_fills_missing_rows_distinct_and_even(corpus):
    ds = build(make_config(corpus, route_missing_policy="balanced", pad_policy="constant"))
    native = build(make_config(corpus, pad_policy="constant"))
    filled_any = False
    for i in range(len(ds)):
        routes, before = ds[i]["routes"].numpy(), native[i]["routes"].numpy()
        was_missing = missing_mask(before)
        assert not missing_mask(routes).any()
        validate_routes(routes, num_layers=LAYERS, num_experts=EXPERTS, topk=TOPK)
        assert np.array_equal(routes[~was_missing], before[~was_missing])
        # Seeded by the pack index, so packs of a micro-batch fill different experts.
        assert np.array_equal(routes, fill_missing_balanced(before, EXPERTS, seed=i))
        for layer in range(LAYERS):
            fill = routes[was_missing[:, layer], layer]
            filled_any |= fill.shape[0] > 1
            for ep in (1, 2, 4, 8):
                counts = rank_counts(fill, EXPERTS, ep)
                assert counts.max() - counts.min() <= 1
    assert filled_any


def test_blend_and_pack_cache(corpus):
    prefixes = [os.path.join(corpus["root"], n) for n in "ab"]
    blended = build(make_config(corpus, blend=(prefixes, [0.5, 0.5])), size=80)
    assert isinstance(blended, BlendedDataset)
    assert {int(blended[i]["dataset_id"]) for i in range(len(blended))} == {0, 1}
    again = build(make_config(corpus))
    assert again.cache_hit
    assert np.array_equal(again[3]["routes"].numpy(), build(make_config(corpus))[3]["routes"])


def test_route_and_token_length_mismatch_is_refused(corpus, tmp_path):
    prefix = str(tmp_path / "c")
    docs = write_corpus(prefix, seed=9, num_docs=10)
    routes = [doc_routes(d) for d in docs]
    routes[4] = routes[4][:-1]
    write_routes(prefix + "_routes", routes)
    with pytest.raises(ValueError, match=r"_routes document 4 has"):
        build(
            make_config(corpus, blend=([prefix], None), path_to_cache=str(tmp_path / "cache")),
            size=5,
        )


def test_bad_route_ids_are_refused_at_build_naming_document_token_and_layer(corpus, tmp_path):
    # Used to be found only when the pack was read (mid-training, naming a pack position).
    prefix = str(tmp_path / "d")
    docs = write_corpus(prefix, seed=5, num_docs=10)
    routes = [doc_routes(d) for d in docs]
    routes[3][2, 1] = [3, 3]  # duplicate top-k: document 3, token 2, layer 1
    write_routes(prefix + "_routes", routes)
    config = make_config(corpus, blend=([prefix], None), path_to_cache=str(tmp_path / "cache"))
    with pytest.raises(
        ValueError, match=r"d_routes: document 3, token 2, MoE layer 1 has duplicate expert ids"
    ):
        build(config, size=5)
    routes[3][2, 1] = [3, 9]  # id >= E
    write_routes(prefix + "_routes", routes)
    with pytest.raises(ValueError, match=r"document 3, token 2, MoE layer 1 has an expert id >= "):
        build(config, size=5)
    routes[3][2, 1] = [255, 1]  # a partial missing marker
    write_routes(prefix + "_routes", routes)
    with pytest.raises(ValueError, match=r"token 2, MoE layer 1 mixes the missing-row marker"):
        build(config, size=5)


def test_validation_is_cached_by_the_route_files_identity(corpus, tmp_path):
    prefix, cache = str(tmp_path / "v"), str(tmp_path / "cache")
    docs = write_corpus(prefix, seed=6, num_docs=10)
    config = make_config(corpus, blend=([prefix], None), path_to_cache=cache)
    build(config, size=5)
    markers = [f for f in os.listdir(cache) if f.endswith("-validated.txt")]
    assert len(markers) == 1
    with open(os.path.join(cache, markers[0])) as f:
        assert file_identity(prefix + "_routes.bin") in f.read()
    routes = [doc_routes(d) for d in docs]
    routes[0][0, 0] = [1, 1]
    write_routes(prefix + "_routes", routes)  # rewritten: a new identity, validated again
    with pytest.raises(ValueError, match="document 0, token 0, MoE layer 0 has duplicate"):
        build(config, size=5)


@pytest.mark.parametrize(
    "layers, topk, experts, match",
    [
        (4, 1, EXPERTS, r"written for 2 MoE layers x top-2 over 8 experts; the model has 4 MoE"),
        (LAYERS, TOPK, 16, r"written for 2 MoE layers x top-2 over 8 experts; .* over 16 experts"),
        (3, TOPK, EXPERTS, r"written for 2 MoE layers x top-2 .* 3 MoE layers x top-2"),
    ],
)
def test_route_file_for_another_model_is_refused_by_its_header(
    corpus, layers, topk, experts, match
):
    # L=2, K=2 and L=4, K=1 both store 4 ids per token: only the header tells them apart.
    config = make_config(
        corpus, route_num_layers=layers, route_topk=topk, route_num_experts=experts
    )
    with pytest.raises(ValueError, match=match):
        build(config, size=5)


def test_headerless_route_file_warns_and_wrong_width_is_named_in_layers(corpus, tmp_path):
    prefix = str(tmp_path / "old")
    write_corpus(prefix, seed=8, num_docs=6)
    os.remove(prefix + "_routes.routes.json")  # as written before headers existed
    config = make_config(corpus, blend=([prefix], None), path_to_cache=str(tmp_path / "c"))
    with pytest.warns(UserWarning, match="has no header"):
        assert len(build(config, size=5)) == 5
    three = make_config(
        corpus, blend=([prefix], None), path_to_cache=str(tmp_path / "c"), route_num_layers=3
    )
    with (
        pytest.warns(UserWarning),
        pytest.raises(
            ValueError,
            match=r"holds 4 expert ids per token, the model needs 3 MoE layers x top-2 = 6",
        ),
    ):
        build(three, size=5)


def test_missing_route_file_is_refused(corpus, tmp_path):
    prefix = str(tmp_path / "e")
    write_documents(prefix, [np.arange(1, 5)])
    with pytest.raises((ValueError, FileNotFoundError), match="e_routes"):
        build(
            make_config(corpus, blend=([prefix], None), path_to_cache=str(tmp_path / "cache")),
            size=2,
        )


def test_recorder_writes_routes_aligned_with_documents(corpus, tmp_path):
    # Record mode: no route sidecar is read; samples carry pack_index for the recorder.
    ds = build(make_config(corpus, pad_policy="self", route_suffix=None))
    assert "routes" not in ds[0] and int(ds[1]["pack_index"]) == 1
    recorder = RouteRecorder.for_dataset(ds)
    for i in range(len(ds)):
        recorded = route_of(ds[i]["tokens"].numpy())  # what a forward "chose" at every position
        recorder.add_pack(ds.pack_pieces(i), recorded)
    prefix = str(tmp_path / "recorded")
    assert recorder.write(prefix) == len(corpus["docs"]["a"])
    assert os.path.isfile(prefix + ".routes.json")  # L, K, E beside the pair
    with pytest.raises(ValueError, match=r"recorded\.bin already exists"):
        recorder.write(prefix)  # a second write never replaces a recording silently
    assert recorder.recorded_tokens > 0
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    back = IndexedDataset(prefix)
    covered = 0
    for d, doc in enumerate(corpus["docs"]["a"]):
        got = back[d].reshape(-1, LAYERS, TOPK)
        seen = ~missing_mask(got)
        assert np.array_equal(got[seen], route_of(doc)[seen])
        covered += int(seen[:, 0].sum())
    in_plan = set(ds.plan["piece_doc_Q"].tolist())
    assert covered == sum(len(corpus["docs"]["a"][d]) for d in in_plan) > 0


def test_routes_beside_rewritten_tokens_of_the_same_lengths_are_refused(
    corpus, tmp_path, monkeypatch
):
    """The header's tokens_digest ties the routes to the token data they were written for: new
    token values of the same lengths (every length check passes) are refused, not replayed with
    another text's routes. The token files are read once per state (cached like validation)."""
    from megatron_ext.common import safe_files
    from megatron_ext.replay.route_file import read_header

    prefix, cache = str(tmp_path / "t"), str(tmp_path / "cache")
    rng = np.random.default_rng(8)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(2, 45, size=10)]
    write_documents(prefix, docs)
    write_route_sidecar(
        prefix + "_routes", [doc_routes(d) for d in docs], num_layers=LAYERS, topk=TOPK,
        num_experts=EXPERTS, tokens_prefix=prefix,
    )  # fmt: skip
    assert "tokens_digest" in read_header(prefix + "_routes.routes.json")
    config = make_config(corpus, blend=([prefix], None), path_to_cache=cache)
    build(config, size=5)
    real_digest, reads = safe_files.content_digest, []
    monkeypatch.setattr(
        safe_files, "content_digest", lambda paths: reads.append(paths) or real_digest(paths)
    )
    build(config, size=5)
    assert reads == []  # unchanged tokens: the pass is remembered, not read again
    write_documents(prefix, [(d + 1) % 100 for d in docs])  # same lengths, other tokens
    with pytest.raises(ValueError, match="written for other token data than .*t "):
        build(config, size=5)
    assert len(reads) == 1


def test_route_file_without_tokens_digest_warns_once_naming_it(corpus, tmp_path, monkeypatch):
    """Routes converted without --tokens-prefix cannot be tied to their tokens: one warning per
    file and launch (the dataset is built once per split and per build), none with a digest."""
    import warnings

    from megatron_ext.replay import route_dataset

    monkeypatch.setattr(route_dataset, "_WARNED_NO_DIGEST", set())  # a fresh launch
    prefix = str(tmp_path / "nd")
    rng = np.random.default_rng(9)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(2, 45, size=10)]
    write_documents(prefix, docs)
    write_routes(prefix + "_routes", [doc_routes(d) for d in docs])  # no tokens_prefix
    config = make_config(corpus, blend=([prefix], None), path_to_cache=str(tmp_path / "c"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(config, size=5)
        build(config, size=5)
    digest = [w for w in caught if "records no tokens digest" in str(w.message)]
    assert len(digest) == 1 and f"{prefix}_routes " in str(digest[0].message)
    assert "--tokens-prefix" in str(digest[0].message)
    write_route_sidecar(
        prefix + "_routes", [doc_routes(d) for d in docs], num_layers=LAYERS, topk=TOPK,
        num_experts=EXPERTS, tokens_prefix=prefix, overwrite=True,
    )  # fmt: skip
    monkeypatch.setattr(route_dataset, "_WARNED_NO_DIGEST", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(config, size=5)
    assert not [w for w in caught if "records no tokens digest" in str(w.message)]
