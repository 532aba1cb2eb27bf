"""Tier: pure (numpy only). Route format, validation, padding, missing-route policies, T-1."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.replay.route_file import BLOCK_VALUES, first_invalid_row
from megatron_ext.replay.routes import (
    apply_missing_policy,
    balanced_experts,
    fill_missing_balanced,
    missing_mask,
    missing_routes,
    missing_value,
    pad_routes,
    rank_counts,
    reconcile_t_minus_1,
    route_dtype,
    validate_routes,
)
from tests.import_probe import imported_from


def _routes(num_tokens: int, num_layers: int, topk: int, num_experts: int, seed: int = 0):
    """Random valid routes: each row a distinct top-k."""
    rng = np.random.default_rng(seed)
    out = np.empty((num_tokens, num_layers, topk), dtype=route_dtype(num_experts, topk))
    for t in range(num_tokens):
        for layer in range(num_layers):
            out[t, layer] = rng.permutation(num_experts)[:topk]
    return out


def test_pure_module_never_imports_megatron():
    assert (
        imported_from(
            [
                "megatron_ext.replay.routes",
                "megatron_ext.replay.layout",
                "megatron_ext.replay.rollout_routes",
                "megatron_ext.replay.unsupported",
                "megatron_ext.replay.moe_layer_map",
                "megatron_ext.replay.vllm_routes",
                "megatron_ext.replay.route_records",
                "megatron_ext.replay.safetensors_routes",
                "megatron_ext.replay.route_conversion",
                "megatron_ext.replay.rollout_ingest",
                "megatron_ext.data.sidecar_header",
                "megatron_ext.replay.route_ids",
                "megatron_ext.training.policy_loss",
                "megatron_ext.training.logprob_record",
            ],
            ["megatron"],
        )
        == []
    )


@pytest.mark.parametrize(
    "num_experts, topk, dtype",
    [
        (1, 1, np.uint8),
        (8, 2, np.uint8),
        (255, 1, np.uint8),
        (256, 8, np.uint8),
        (256, 1, np.uint16),
        (257, 2, np.uint16),
        (65535, 4, np.uint16),
    ],
)
def test_route_dtype_is_the_narrowest_that_keeps_the_missing_marker(num_experts, topk, dtype):
    assert route_dtype(num_experts, topk) == dtype


@pytest.mark.parametrize("num_experts, topk", [(65536, 2), (4, 5), (0, 1)])
def test_route_dtype_rejects_impossible_shapes(num_experts, topk):
    with pytest.raises(ValueError):
        route_dtype(num_experts, topk)


def test_validate_accepts_real_and_missing_rows():
    routes = _routes(6, 3, 2, 8)
    routes[5] = missing_value(routes.dtype)
    validate_routes(routes, num_layers=3, num_experts=8, topk=2)
    assert missing_mask(routes).sum() == 3  # the one missing token, at all 3 layers


def test_validate_accepts_id_255_with_256_experts_in_uint8():
    routes = np.array([[[255, 3]], [[255, 255]]], dtype=np.uint8)  # row 1 is the missing marker
    validate_routes(routes, num_layers=1, num_experts=256, topk=2)
    assert missing_mask(routes)[:, 0].tolist() == [False, True]


@pytest.mark.parametrize(
    "mutate, kwargs, match",
    [
        (None, {"num_layers": 4}, "has 3 MoE layers, the model has 4"),
        (None, {"topk": 3}, "top-k 2"),
        (lambda r: r.__setitem__((4, 1, 0), 9), {}, r"token 4, MoE layer 1 has an expert id >= "),
        (lambda r: r.__setitem__((2, 2), [5, 5]), {}, "token 2, MoE layer 2 has duplicate"),
        (lambda r: r.__setitem__((3, 0, 1), 255), {}, "token 3, MoE layer 0 mixes the missing"),
    ],
)
def test_validate_names_layer_and_token(mutate, kwargs, match):
    routes = _routes(6, 3, 2, 8)
    if mutate is not None:
        mutate(routes)
    args = {"num_layers": 3, "num_experts": 8, "topk": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        validate_routes(routes, **args)


def test_validate_token_offset_and_name_reach_the_message():
    routes = _routes(3, 1, 2, 4)
    routes[1, 0] = [1, 1]
    with pytest.raises(ValueError, match=r"doc 7: token 101, MoE layer 0"):
        validate_routes(routes, num_layers=1, num_experts=4, topk=2, name="doc 7", token_offset=100)


def test_validate_rejects_bad_rank_and_dtype():
    with pytest.raises(ValueError, match="tokens, moe_layers, topk"):
        validate_routes(np.zeros((3, 2), np.uint8), num_layers=2, num_experts=4, topk=2)
    with pytest.raises(ValueError, match="uint8 or uint16"):
        validate_routes(np.zeros((3, 1, 2), np.int32), num_layers=1, num_experts=4, topk=2)


def test_validate_empty_buffer():
    validate_routes(missing_routes(0, 2, 2, np.uint8), num_layers=2, num_experts=4, topk=2)


def _whole_buffer_error(routes_TLK, num_experts, name="routes", token_offset=0):
    """The whole-buffer validation the blocked one replaced ([T, L, K] masks and a sorted copy):
    the reference for its errors. Returns the message, None if the buffer is valid."""
    marker = missing_value(routes_TLK.dtype)
    is_marker_TLK = routes_TLK == marker
    missing_TL = is_marker_TLK.all(axis=-1)
    partial_TL = is_marker_TLK.any(axis=-1) & ~missing_TL
    if num_experts > marker:
        partial_TL[:] = False
    out_of_range_TL = ((routes_TLK >= num_experts) & ~is_marker_TLK).any(axis=-1) & ~missing_TL
    sorted_TLK = np.sort(routes_TLK, axis=-1)
    duplicate_TL = (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(axis=-1) & ~missing_TL
    for bad_TL, what in (
        (partial_TL, "mixes the missing-row marker with real ids"),
        (out_of_range_TL, f"has an expert id >= num_experts ({num_experts})"),
        (duplicate_TL, "has duplicate expert ids in its top-k"),
    ):  # rule-major: the first row breaking the first rule any row breaks
        if bad_TL.any():
            token, layer = (int(v) for v in np.argwhere(bad_TL)[0])
            return f"{name}: token {token + token_offset}, MoE layer {layer} {what}"
    return None


def _blocked_error(routes_TLK, num_experts, **kwargs):
    """validate_routes' message, None if it accepts the buffer."""
    num_layers, topk = routes_TLK.shape[1:]
    try:
        validate_routes(
            routes_TLK, num_layers=num_layers, num_experts=num_experts, topk=topk, **kwargs
        )
    except ValueError as err:
        return str(err)
    return None


def _fast_routes(num_tokens, num_layers, topk, num_experts, seed=0):
    """Random valid routes, vectorized: a random first id plus increasing offsets below E
    (steps in [1, E // K]), so each row's K ids are distinct mod E."""
    rng = np.random.default_rng(seed)
    first = rng.integers(num_experts, size=(num_tokens, num_layers, 1))
    steps = rng.integers(1, num_experts // topk + 1, size=(num_tokens, num_layers, topk))
    offsets = np.cumsum(steps, axis=-1) - steps[..., :1]  # 0 < ... <= (K - 1) E / K < E
    return ((first + offsets) % num_experts).astype(route_dtype(num_experts, topk))


# Blocked-validation geometry: L = 4, K = 2, so a block holds BLOCK_VALUES // 8 rows, and a
# buffer of 9 blocks + 37 rows is large enough that no block is shrunk to an eighth of it.
_L, _K, _E = 4, 2, 8
_BLOCK = BLOCK_VALUES // (_L * _K)
_ROWS = 9 * _BLOCK + 37

# Each case: (token, layer, entries) edits; the token of the error, and the block it lies in.
_DUP, _BIG, _MIX = [3, 3], [2, 9], [5, 255]
_EDGE = 2 * _BLOCK  # first row of the third block
_BLOCK_CASES = {
    "first block": ([(3, 1, _DUP)], 3),
    "later block": ([(_EDGE + 11, 2, _BIG)], _EDGE + 11),
    "last row": ([(_ROWS - 1, 3, _MIX)], _ROWS - 1),
    # Across a block edge: the worse rule wins in the next block, the first row in a tie.
    "edge: dup before, mix after": ([(_EDGE - 1, 3, _DUP), (_EDGE, 0, _MIX)], _EDGE),
    "edge: big before, dup after": ([(_EDGE - 1, 3, _BIG), (_EDGE, 0, _DUP)], _EDGE - 1),
    "edge: dup before, big after": ([(_EDGE - 1, 0, _DUP), (_EDGE, 3, _BIG)], _EDGE),
    "edge: mix before and after": ([(_EDGE - 1, 3, _MIX), (_EDGE, 0, _MIX)], _EDGE - 1),
    # Rule-major across far blocks, and within one row (a dup at layer 0, a mix at layer 2).
    "dup first, big later, mix last": (
        [(2, 0, _DUP), (_BLOCK + 5, 1, _BIG), (8 * _BLOCK + 1, 2, _MIX)],
        8 * _BLOCK + 1,
    ),
    "dup and mix in one row": ([(_BLOCK + 7, 0, _DUP), (_BLOCK + 7, 2, _MIX)], _BLOCK + 7),
}


@pytest.mark.parametrize("case", list(_BLOCK_CASES))
def test_blocked_validation_names_the_same_row_as_the_whole_buffer_check(case):
    assert -(-_ROWS // 8) >= _BLOCK  # full-sized blocks: the edges above are block edges
    edits, token = _BLOCK_CASES[case]
    routes = _fast_routes(_ROWS, _L, _K, _E)
    assert _blocked_error(routes, _E) is None
    for row, layer, entries in edits:
        routes[row, layer] = entries
    expected = _whole_buffer_error(routes, _E, name="doc 3", token_offset=1000)
    assert expected is not None and f": token {token + 1000}, MoE layer" in expected
    assert _blocked_error(routes, _E, name="doc 3", token_offset=1000) == expected
    if case.startswith("edge"):  # the two edits do lie on either side of a block edge
        assert [row // _BLOCK for row, _, _ in edits] == [1, 2]
    if case == "later block":
        assert token // _BLOCK == 2


@pytest.mark.parametrize(
    "num_experts, topk, num_layers",
    [(8, 2, 4), (8, 1, 3), (256, 2, 2), (256, 1, 2), (300, 3, 1), (65535, 2, 2), (4, 4, 5)],
)
def test_blocked_validation_matches_the_whole_buffer_check_on_random_corruption(
    num_experts, topk, num_layers
):
    rng = np.random.default_rng(num_experts * 10 + topk)
    rows = 3 * BLOCK_VALUES // (num_layers * topk) + 5  # several blocks
    clean = _fast_routes(rows, num_layers, topk, num_experts, seed=topk)
    marker = missing_value(clean.dtype)
    outcomes = set()
    for trial in range(12):
        routes = clean.copy()
        routes[rng.integers(rows, size=3)] = marker  # missing rows, valid everywhere
        for _ in range(trial % 4):  # 0..3 single-entry corruptions; trials 0, 4, 8 clean
            token, layer, slot = (int(rng.integers(n)) for n in (rows, num_layers, topk))
            row = routes[token, layer]
            # the marker, a too-large id (wraps to 0 for 256 uint8 experts), another slot's id
            row[slot] = rng.choice([marker, num_experts % (marker + 1), row[(slot + 1) % topk]])
        expected = _whole_buffer_error(routes, num_experts, token_offset=trial)
        assert _blocked_error(routes, num_experts, token_offset=trial) == expected
        outcomes.add(expected is None)
    assert outcomes == {True, False}  # both accepted and rejected buffers were compared


def test_blocked_validation_is_rule_major_not_row_major():
    # Guard for the cases above: the error is not simply the first bad row.
    routes = _fast_routes(_ROWS, _L, _K, _E)
    routes[0, 0] = _DUP
    routes[3 * _BLOCK, 1] = _MIX
    assert first_invalid_row(routes, _E)[0] == 0
    assert f"token {3 * _BLOCK}, MoE layer 1 mixes" in _blocked_error(routes, _E)


def test_validation_of_k_zero_and_no_layers_accepts_as_before():
    for shape in [(5, 3, 0), (5, 0, 2)]:
        routes = np.zeros(shape, np.uint8)
        assert _whole_buffer_error(routes, 4) is None
        validate_routes(routes, num_layers=shape[1], num_experts=4, topk=shape[2])


# Peak extra memory of validating an 8 MiB buffer: under an eighth of it, whatever the size
# (the block's [rows, L] temporaries, ~0.2 MiB here); the whole-buffer check took over 4x it.
_PEAK_BOUND = 1 << 20


@pytest.mark.parametrize("edits", ["valid", "dup first, big last"])
def test_validation_peak_memory_is_bounded_by_the_block(edits):
    num_tokens = 1 << 20  # 8 MiB of uint8 routes at L = 4, K = 2: 128 blocks
    routes = np.empty((num_tokens, _L, _K), np.uint8)
    routes[..., 0] = np.arange(num_tokens * _L).reshape(num_tokens, _L) % _E
    routes[..., 1] = (routes[..., 0] + 1) % _E
    if edits != "valid":  # the error path scans the whole buffer a second time
        routes[0, 0] = _DUP
        routes[-1, 3] = _BIG
    peaks = {}
    for label, check in (("blocked", _blocked_error), ("whole", _whole_buffer_error)):
        tracemalloc.start()
        try:
            message = check(routes, _E)
            peaks[label] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert (message is None) == (edits == "valid")
        if message is not None:
            assert f"token {num_tokens - 1}, MoE layer 3 has an expert id" in message
    assert peaks["blocked"] < _PEAK_BOUND, peaks
    assert peaks["whole"] > 4 * routes.nbytes, peaks  # tracemalloc does see numpy's buffers


def test_pad_routes_hand_worked():
    # tokens [a b c] padded to [a b c a b] (self-token) and [a b c _ _] (constant id).
    routes = np.array([[[0, 1]], [[2, 3]], [[4, 5]]], dtype=np.uint8)
    self_padded = pad_routes(routes, np.array([0, 1, 2, 0, 1]))
    assert self_padded[:, 0].tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    const_padded = pad_routes(routes, np.array([0, 1, 2, -1, -1]))
    assert missing_mask(const_padded)[:, 0].tolist() == [False, False, False, True, True]
    assert const_padded[:3].tolist() == routes.tolist()


def test_pad_routes_matches_a_loop_reference():
    rng = np.random.default_rng(3)
    routes = _routes(17, 4, 3, 16, seed=1)
    src = rng.integers(-1, 17, size=40)
    got = pad_routes(routes, src)
    for s, i in enumerate(src):
        want = missing_routes(1, 4, 3, routes.dtype)[0] if i < 0 else routes[i]
        assert np.array_equal(got[s], want)
    assert (src < 0).any() and (src >= 0).any()  # both kinds of pad occurred


def test_pad_routes_rejects_out_of_range_and_handles_empty():
    routes = _routes(3, 1, 2, 4)
    with pytest.raises(ValueError, match=r"\[-1, 3\)"):
        pad_routes(routes, np.array([0, 3]))
    empty = pad_routes(missing_routes(0, 1, 2, np.uint8), np.array([-1, -1]))
    assert missing_mask(empty).all() and empty.shape == (2, 1, 2)
    assert pad_routes(routes, np.array([], dtype=np.int64)).shape == (0, 1, 2)


def test_fill_missing_balanced_hand_worked():
    # E = 8, K = 2, three missing rows at layer 0 -> 6 slots, 6 evenly spaced experts.
    routes = missing_routes(3, 1, 2, np.uint8)
    filled = fill_missing_balanced(routes, num_experts=8)
    assert filled[:, 0].tolist() == [[0, 1], [2, 4], [5, 6]]
    assert rank_counts(filled, 8, 2).tolist() == [3, 3]
    assert rank_counts(filled, 8, 4).tolist() == [2, 1, 2, 1]


def test_fill_missing_balanced_keeps_real_rows_and_fills_only_missing():
    routes = _routes(20, 3, 2, 8, seed=4)
    routes[[3, 7, 19], 1] = missing_value(routes.dtype)
    routes[0] = missing_value(routes.dtype)
    filled = fill_missing_balanced(routes, num_experts=8)
    was_missing = missing_mask(routes)
    assert np.array_equal(filled[~was_missing], routes[~was_missing])
    assert not missing_mask(filled).any()
    validate_routes(filled, num_layers=3, num_experts=8, topk=2)


@settings(max_examples=300, deadline=None)
@given(
    num_experts=st.integers(1, 256),
    topk_frac=st.floats(0.0, 1.0),
    missing_rows=st.integers(0, 300),
    layer=st.integers(0, 5),
    seed=st.integers(0, 10**6),
)
def test_balanced_rows_meet_the_per_ep_rank_bound_for_every_ep_size(
    num_experts, topk_frac, missing_rows, layer, seed
):
    topk = 1 + int(topk_frac * (min(num_experts, 8) - 1))
    routes = missing_routes(missing_rows, layer + 1, topk, route_dtype(num_experts, topk))
    filled = fill_missing_balanced(routes, num_experts, seed)
    validate_routes(filled, num_layers=layer + 1, num_experts=num_experts, topk=topk)  # distinct
    for ep in range(1, 65):
        if num_experts % ep == 0:
            counts = rank_counts(filled[:, layer], num_experts, ep)
            assert counts.max() - counts.min() <= 1, (ep, counts)


def test_balanced_property_covers_the_interesting_cases():
    # Non-vacuity: a remainder that is not a multiple of any rank count, at a non-power-of-2 E.
    filled = fill_missing_balanced(missing_routes(7, 1, 2, np.uint8), num_experts=12)
    for ep, want in [(2, [7, 7]), (3, [5, 5, 4]), (4, [4, 3, 4, 3]), (6, [3, 2, 3, 2, 2, 2])]:
        counts = rank_counts(filled, 12, ep)
        assert sorted(counts.tolist()) == sorted(want), (ep, counts)
    # Contrast: the zero-byte fill many frameworks use puts every slot on rank 0.
    zeros = np.zeros((7, 1, 2), dtype=np.uint8)
    assert rank_counts(zeros, 12, 2).tolist() == [14, 0]


@settings(max_examples=40, deadline=None)
@given(
    num_experts=st.sampled_from([8, 12, 16, 64, 128]),
    topk=st.integers(1, 8),
    missing_per_pack=st.integers(1, 3),
    num_packs=st.integers(2, 64),
    first_pack=st.integers(0, 10**5),
)
def test_balanced_fill_stays_balanced_across_the_packs_of_a_micro_batch(
    num_experts, topk, missing_per_pack, num_packs, first_pack
):
    # Every pack has the same few missing rows (the common case: each pack's last token).
    # A layer-only phase gave each pack the same experts: with one missing row, K = 2, E = 8,
    # experts 0 and 4 took all 2 * num_packs slots. The per-pack seed spreads them over a
    # golden-ratio sequence; 4 is the worst spread measured (not a proven bound; within one pack
    # the bound stays 1, tested above) over every window of 2..64 consecutive packs starting at
    # 0..100000 for E, K in (8, 1), (8, 2), (12, 1), (16, 3), and starting at 0..1500 for every
    # E drawn here, K in 1, 2, 3, 8 and 1..3 missing rows. (3, claimed before, fails: E = 8, K = 1, 46
    # packs from 6661 give 21 and 25 at EP = 2.)
    routes = missing_routes(missing_per_pack, 1, topk, route_dtype(num_experts, topk))
    packs = [
        fill_missing_balanced(routes, num_experts, seed=first_pack + p) for p in range(num_packs)
    ]
    for ep in range(1, 65):
        if num_experts % ep == 0:
            counts = rank_counts(np.concatenate(packs), num_experts, ep)
            assert counts.max() - counts.min() <= 4, (ep, counts)


def test_balanced_fill_differs_per_pack_hand_worked():
    # E = 8, K = 2, one missing row per pack (r = 2 points (c + 8j) // 2), packs 0..7:
    # c = floor(8 * frac(p * 0.618...)) = 0 4 1 6 3 0 5 2 -> pairs {0,4} {2,6} {0,4} {3,7} {1,5}
    # {0,4} {2,6} {1,5}. With seed 0 everywhere (the old behaviour) experts 0 and 4 took all 16.
    one = missing_routes(1, 1, 2, np.uint8)
    packs = np.concatenate([fill_missing_balanced(one, 8, seed=p) for p in range(8)])
    assert packs[:, 0].tolist() == [
        [0, 4], [2, 6], [0, 4], [3, 7], [1, 5], [0, 4], [2, 6], [1, 5]
    ]  # fmt: skip
    assert rank_counts(packs, 8, 8).tolist() == [3, 2, 2, 1, 3, 2, 2, 1]
    assert rank_counts(packs, 8, 4).tolist() == [5, 3, 5, 3]
    same = np.concatenate([fill_missing_balanced(one, 8) for _ in range(8)])
    assert rank_counts(same, 8, 8).tolist() == [8, 0, 0, 0, 8, 0, 0, 0]


def test_balanced_experts_windows_are_distinct_across_cycles():
    seq = balanced_experts(3 * 8 + 5, 8, phase=0.5)
    for start in range(len(seq) - 8):
        assert len(set(seq[start : start + 8].tolist())) == 8


def test_balanced_single_expert_and_everything_on_one_expert():
    filled = fill_missing_balanced(missing_routes(4, 2, 1, np.uint8), num_experts=1)
    assert (filled == 0).all()


def test_balanced_pad_replays_its_sources_fill_hand_worked():
    # routes [ra -- rc | -- --], src_index [0 1 2 1 -1]: rows 1 and 4 are filled (4 slots:
    # experts (8j) // 4 = 0 2 4 6 -> [0 2] [4 6]); the pad at 3 copies token 1's fill.
    routes = np.full((5, 1, 2), 255, dtype=np.uint8)
    routes[0, 0], routes[2, 0] = [3, 5], [7, 1]
    src_index = np.array([0, 1, 2, 1, -1])
    filled = fill_missing_balanced(routes, 8, src_index_T=src_index)
    assert filled[:, 0].tolist() == [[3, 5], [0, 2], [7, 1], [0, 2], [4, 6]]
    # Without the source index the pad got a fill of its own: [2 4] against its source's [0 1].
    alone = fill_missing_balanced(routes, 8)
    assert alone[1, 0].tolist() == [0, 1] and alone[3, 0].tolist() == [2, 4]


@settings(max_examples=60, deadline=None)
@given(
    doc_lens=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    extra=st.integers(0, 30),
    policy=st.sampled_from(["self", "constant"]),
    seed=st.integers(0, 10**4),
)
def test_balanced_self_pads_replay_exactly_what_their_source_replays(doc_lens, extra, policy, seed):
    """Real self-token padding (data.padding.pad_pack) of routes with missing rows: after the
    balanced fill every pad row equals its source row, real rows keep their routes, and the rows
    filled are exactly the fill of the unpadded pack (one EP-balanced fill, not two)."""
    from megatron_ext.data.padding import pad_pack

    lens = np.array(doc_lens)
    tokens = np.arange(1, lens.sum() + 1)
    routes = _routes(int(lens.sum()), 2, 2, 8, seed=seed)
    routes[np.cumsum(lens) - 1] = missing_value(routes.dtype)  # vLLM: each document's last token
    pack = pad_pack(tokens, lens, length=int(lens.sum()) + extra, policy=policy)
    padded = pad_routes(routes, pack.src_index_S)
    filled = apply_missing_policy(padded, "balanced", 8, seed, src_index_T=pack.src_index_S)
    assert not missing_mask(filled).any()
    copies = pack.src_index_S >= 0
    assert np.array_equal(filled[copies], filled[pack.src_index_S[copies]])
    real = np.arange(lens.sum())
    assert np.array_equal(filled[real][~missing_mask(routes)], routes[~missing_mask(routes)])
    own = ~copies | (pack.src_index_S == np.arange(pack.src_index_S.size))
    assert np.array_equal(filled[own], fill_missing_balanced(padded[own], 8, seed))


def test_balanced_self_pad_case_occurs_and_the_unindexed_fill_breaks_it():
    # Non-vacuity for the property above: pads copying a missing row occur, and the fill without
    # src_index gives those pads experts of their own (the disagreement this fixes).
    from megatron_ext.data.padding import pad_pack

    lens = np.array([3, 4])
    routes = _routes(7, 2, 2, 8)
    routes[[2, 6]] = missing_value(routes.dtype)
    pack = pad_pack(np.arange(1, 8), lens, length=16, policy="self")  # pads copy 0..6, 0, 1
    padded = pad_routes(routes, pack.src_index_S)
    assert pack.src_index_S[[9, 13]].tolist() == [2, 6]  # two pads copy the missing rows
    assert missing_mask(padded).all(-1).nonzero()[0].tolist() == [2, 6, 9, 13]
    # Unindexed: 4 rows x 2 slots = one cycle over 8 experts, each row its own pair.
    unindexed = fill_missing_balanced(padded, 8)
    assert unindexed[[2, 9], 0].tolist() == [[0, 1], [4, 5]]
    indexed = fill_missing_balanced(padded, 8, src_index_T=pack.src_index_S)
    assert np.array_equal(indexed[[9, 13]], indexed[[2, 6]])


def test_balanced_fill_refuses_a_bad_src_index():
    routes = missing_routes(3, 1, 2, np.uint8)
    with pytest.raises(ValueError, match="src_index has shape"):
        fill_missing_balanced(routes, 8, src_index_T=np.array([0, 1]))
    with pytest.raises(ValueError, match="outside"):
        fill_missing_balanced(routes, 8, src_index_T=np.array([0, 1, 3]))
    with pytest.raises(ValueError, match="row 2 copies row 1, which is itself a copy"):
        fill_missing_balanced(routes, 8, src_index_T=np.array([0, 0, 1]))


def test_apply_missing_policy():
    routes = missing_routes(2, 1, 2, np.uint8)
    assert apply_missing_policy(routes, "native", 8) is routes
    assert not missing_mask(apply_missing_policy(routes, "balanced", 8)).any()
    with pytest.raises(ValueError, match="--replay-missing-route-policy"):
        apply_missing_policy(routes, "zeros", 8)


def test_reconcile_t_minus_1():
    routes = _routes(4, 2, 2, 8)
    full = reconcile_t_minus_1(routes, 5)
    assert full.shape == (5, 2, 2) and np.array_equal(full[:4], routes)
    assert missing_mask(full)[4].all() and not missing_mask(full)[:4].any()
    assert reconcile_t_minus_1(routes, 4) is routes
    with pytest.raises(ValueError, match="3 route rows for 5 tokens"):
        reconcile_t_minus_1(routes[:3], 5)
