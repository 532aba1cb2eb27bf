"""Tests for megatron_ext.data.padding. Tier: pure (numpy only, no Megatron, no processes but one
subprocess that checks the module never imports megatron)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ext.data.padding import (
    IGNORE_INDEX,
    check_fill,
    derive_pad_multiple,
    gather_by_src_index,
    pad_pack,
    padded_doc_lengths,
    padded_lengths,
    real_positions,
    round_up,
    target_length,
)
from tests.import_probe import imported_from

X = IGNORE_INDEX


def test_module_never_imports_megatron() -> None:
    assert (
        imported_from(
            [
                "megatron_ext.data.padding",
                "megatron_ext.data.pad_fill",
                "megatron_ext.data.pack_planning",
                "megatron_ext.data.pack_index_cache",
                "megatron_ext.common.safe_files",
                "megatron_ext.data.tool_errors",
            ],
            ["megatron"],
        )
        == []
    )


def test_hand_worked_self_padding() -> None:
    # docs [a b c] [d e] with a..e = 10..14, S = 8: 3 pads copy real tokens 0, 1, 2.
    p = pad_pack(np.array([10, 11, 12, 13, 14]), np.array([3, 2]), 8)
    assert p.tokens_S.tolist() == [10, 11, 12, 13, 14, 10, 11, 12]
    assert p.src_index_S.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert p.labels_S.tolist() == [11, 12, X, 14, X, X, X, X]
    assert p.loss_mask_S.tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert p.position_ids_S.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert p.pad_mask_S.tolist() == [False] * 5 + [True] * 3
    assert p.cu_seqlens.tolist() == [0, 3, 5, 8, 8, 8, 8, 8, 8]
    assert p.cu_seqlens.dtype == np.int32 and p.src_index_S.dtype == np.int64
    assert (p.num_segments, p.max_seqlen) == (3, 3)


def test_pads_cycle_past_the_real_tokens() -> None:
    # [a b c] -> [a b c a b c a], the example.
    p = pad_pack(np.array([1, 2, 3]), np.array([3]), 7)
    assert p.tokens_S.tolist() == [1, 2, 3, 1, 2, 3, 1]
    assert p.position_ids_S.tolist() == [0, 1, 2, 0, 1, 2, 3]


def test_constant_policy() -> None:
    p = pad_pack(np.array([10, 11, 12]), np.array([3]), 5, policy="constant", pad_id=7)
    assert p.tokens_S.tolist() == [10, 11, 12, 7, 7]
    assert p.src_index_S.tolist() == [0, 1, 2, -1, -1]
    assert p.labels_S.tolist() == [11, 12, X, X, X]


def test_multimodal_pack_pads_with_constant_id() -> None:
    # 99 is an image placeholder: self policy must not copy it (or anything) into the pads.
    p = pad_pack(np.array([5, 99, 99, 6]), np.array([4]), 6, pad_id=0, placeholder_ids=[99])
    assert p.tokens_S.tolist() == [5, 99, 99, 6, 0, 0]
    assert p.src_index_S.tolist() == [0, 1, 2, 3, -1, -1]
    text = pad_pack(np.array([5, 7, 8, 6]), np.array([4]), 6, placeholder_ids=[99])
    assert text.tokens_S.tolist() == [
        5,
        7,
        8,
        6,
        5,
        7,
    ]  # text-only packs still self-pad


def test_pad_id_equal_to_eos_keeps_real_eos_labels() -> None:
    # eos = 0 = pad id: labels and loss mask come from positions, so the real eos is learned.
    p = pad_pack(np.array([4, 5, 0]), np.array([3]), 6, policy="constant", pad_id=0)
    assert p.labels_S.tolist() == [5, 0, X, X, X, X]
    assert p.loss_mask_S.tolist() == [1, 1, 0, 0, 0, 0]


def test_target_mask_sidecar_masks_prompt_labels() -> None:
    # prompt [p1 p2] then response [r1 r2]: only positions whose label is a response token learn.
    p = pad_pack(np.array([1, 2, 3, 4]), np.array([4]), 6, target_mask_N=np.array([0, 0, 1, 1]))
    assert p.labels_S.tolist() == [2, 3, 4, X, X, X]
    assert p.loss_mask_S.tolist() == [0, 1, 1, 0, 0, 0]


def test_edge_cases_zero_pads_empty_pack_one_token() -> None:
    full = pad_pack(np.array([1, 2, 3, 4]), np.array([2, 2]), 4)
    assert not full.pad_mask_S.any() and full.cu_seqlens.tolist() == [0, 2, 4, 4, 4]
    assert full.num_segments == 2
    empty = pad_pack(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 3, pad_id=9)
    assert empty.tokens_S.tolist() == [9, 9, 9] and empty.src_index_S.tolist() == [-1] * 3
    assert empty.loss_mask_S.sum() == 0 and empty.cu_seqlens.tolist() == [0, 3, 3, 3]
    none = pad_pack(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 0)
    assert none.tokens_S.size == 0 and none.cu_seqlens.tolist() == [0] and none.num_segments == 0
    one = pad_pack(np.array([42]), np.array([1]), 4)
    assert one.tokens_S.tolist() == [42] * 4 and one.loss_mask_S.sum() == 0


def naive_pad(tokens, doc_lens, length, policy, pad_id, placeholders, target_mask):
    """Per-token loop reference, written from the issue's wording."""
    n = len(tokens)
    mm = any(t in placeholders for t in tokens)
    toks, src, lab, lm, pos, pad = [], [], [], [], [], []
    doc_end = []
    for ln in doc_lens:
        for k in range(ln):
            doc_end.append(k == ln - 1)
    for i in range(n):
        toks.append(tokens[i])
        src.append(i)
        if doc_end[i]:
            lab.append(X)
            lm.append(0.0)
        else:
            lab.append(tokens[i + 1])
            lm.append(1.0 if target_mask is None else float(target_mask[i + 1]))
        pad.append(False)
    p = 0
    for ln in doc_lens:
        pos.extend(range(ln))
    for j in range(length - n):
        if policy == "self" and not mm and n > 0:
            toks.append(tokens[j % n])
            src.append(j % n)
        else:
            toks.append(pad_id)
            src.append(-1)
        lab.append(X)
        lm.append(0.0)
        pos.append(j)
        pad.append(True)
        p += 1
    bounds = [0]
    for ln in doc_lens:
        bounds.append(bounds[-1] + ln)
    if p:
        bounds.append(length)
    cu = bounds + [length] * (length + 1 - len(bounds))
    return toks, src, lab, lm, pos, pad, cu


@pytest.mark.parametrize("seed", range(20))
def test_matches_naive_loop_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    doc_lens = rng.integers(1, 9, size=rng.integers(0, 6))
    n = int(doc_lens.sum())
    tokens = rng.integers(0, 12, size=n)
    length = n + int(rng.integers(0, 2 * n + 3))
    policy = ["self", "constant"][seed % 2]
    placeholders = [11] if seed % 3 == 0 else []
    target_mask = rng.integers(0, 2, size=n) if seed % 4 < 2 else None
    got = pad_pack(
        tokens,
        doc_lens,
        length,
        policy=policy,
        pad_id=3,
        placeholder_ids=placeholders,
        target_mask_N=target_mask,
    )
    toks, src, lab, lm, pos, pad, cu = naive_pad(
        tokens.tolist(), doc_lens.tolist(), length, policy, 3, placeholders, target_mask
    )
    assert got.tokens_S.tolist() == toks
    assert got.src_index_S.tolist() == src
    assert got.labels_S.tolist() == lab
    assert got.loss_mask_S.tolist() == lm
    assert got.position_ids_S.tolist() == pos
    assert got.pad_mask_S.tolist() == pad
    assert got.cu_seqlens.tolist() == cu


@st.composite
def packs(draw):
    doc_lens = draw(st.lists(st.integers(1, 12), min_size=0, max_size=6))
    n = sum(doc_lens)
    tokens = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    length = n + draw(st.integers(0, 40))
    policy = draw(st.sampled_from(["self", "constant"]))
    placeholders = draw(st.lists(st.integers(15, 20), max_size=2))
    return (
        np.array(tokens, dtype=np.int64),
        np.array(doc_lens, dtype=np.int64),
        length,
        policy,
        placeholders,
    )


def check_invariants(case) -> str:
    """Asserts the pad invariants of one case; returns which kind of case it was."""
    tokens, doc_lens, length, policy, placeholders = case
    n = tokens.size
    p = pad_pack(tokens, doc_lens, length, policy=policy, pad_id=0, placeholder_ids=placeholders)
    for arr in (p.tokens_S, p.labels_S, p.loss_mask_S, p.position_ids_S, p.pad_mask_S):
        assert arr.shape == (length,)
    assert p.cu_seqlens.shape == (length + 1,) and p.cu_seqlens[-1] == length
    assert p.cu_seqlens[p.num_segments] == length and np.all(np.diff(p.cu_seqlens) >= 0)
    # Pads only after every real token, never trained on, labels ignored.
    assert p.pad_mask_S.tolist() == [False] * n + [True] * (length - n)
    assert not p.loss_mask_S[p.pad_mask_S].any() and (p.labels_S[p.pad_mask_S] == X).all()
    assert np.array_equal(p.tokens_S[:n], tokens)
    # The pad segment is its own: positions restart at 0 and a boundary sits at n.
    if length > n:
        assert n in p.cu_seqlens[: p.num_segments + 1]
        assert p.position_ids_S[n:].tolist() == list(range(length - n))
    # Contents: real or copied tokens agree with src_index.
    copied = p.src_index_S >= 0
    assert np.array_equal(p.tokens_S[copied], tokens[p.src_index_S[copied]])
    multimodal = bool(np.isin(tokens, placeholders).any())
    if length == n:
        return "no pads"
    if multimodal:
        # Never copies anything (so never a placeholder): every pad is the constant id.
        assert (p.tokens_S[n:] == 0).all() and (p.src_index_S[n:] == -1).all()
        assert not np.isin(p.tokens_S[n:], placeholders).any()
        # Did self-padding have a placeholder to copy? (the case the rule exists for)
        cycle = tokens[np.arange(length - n) % n]
        would_copy = policy == "self" and np.isin(cycle, placeholders).any()
        return "multimodal, placeholder in the cycle" if would_copy else "multimodal"
    if policy == "self" and n:
        # A text-only self-padded pack does copy: pads cycle its tokens from the first one.
        assert copied.all() and np.array_equal(p.src_index_S[n:], np.arange(length - n) % n)
        assert np.array_equal(p.tokens_S[n:], tokens[np.arange(length - n) % n])
        return "self copies"
    assert (p.tokens_S[n:] == 0).all() and (p.src_index_S[n:] == -1).all()
    return "constant"


def test_invariants() -> None:
    seen: dict[str, int] = {}

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(packs())
    def run(case) -> None:
        kind = check_invariants(case)
        seen[kind] = seen.get(kind, 0) + 1

    run()
    # Guard against a vacuous pass: both sides of the multimodal rule were exercised.
    assert seen.get("multimodal, placeholder in the cycle", 0) > 0, seen
    assert seen.get("self copies", 0) > 0 and seen.get("constant", 0) > 0, seen


def test_fill_must_fit_the_payload_dtype() -> None:
    check_fill(255, np.uint8, "routes")
    check_fill(-1, np.int16, "routes")
    check_fill(0.5, np.float32, "weights")
    for fill, dtype in ((-1, np.uint8), (256, np.uint8), (0.5, np.int32), (2, np.bool_)):
        with pytest.raises(ValueError, match=f"routes holds .* fill is {fill!r}"):
            check_fill(fill, dtype, "routes")
    with pytest.raises(ValueError, match="weights holds float16 values but .* 1000000.0"):
        check_fill(1e6, np.float16, "weights")
    # gather_by_src_index checks too: a ValueError, not numpy's bare OverflowError.
    c = pad_pack(np.array([7, 8]), np.array([2]), 4, policy="constant")
    with pytest.raises(ValueError, match="payload holds uint8 values"):
        gather_by_src_index(np.array([1, 2], dtype=np.uint8), c.src_index_S, -1)


def test_gather_by_src_index_pads_payload_like_tokens() -> None:
    routes_NW = np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int16)
    p = pad_pack(np.array([7, 8, 9]), np.array([3]), 5)
    assert gather_by_src_index(routes_NW, p.src_index_S, -1).tolist() == [
        [0, 1],
        [2, 3],
        [4, 5],
        [0, 1],
        [2, 3],
    ]
    c = pad_pack(np.array([7, 8, 9]), np.array([3]), 5, policy="constant")
    out = gather_by_src_index(routes_NW, c.src_index_S, -1)
    assert out.dtype == np.int16 and out[3:].tolist() == [[-1, -1]] * 2
    empty = gather_by_src_index(np.zeros((0, 2)), np.array([-1, -1]), 5)
    assert empty.tolist() == [[5, 5], [5, 5]]
    with pytest.raises(ValueError, match="payload has 2 rows"):
        gather_by_src_index(routes_NW[:2], p.src_index_S, -1)


def test_target_length_and_derived_multiple() -> None:
    assert target_length(5, seq_length=16, pad_to_seq_len=True, pad_to_multiple_of=1) == 16
    assert target_length(5, seq_length=16, pad_to_seq_len=False, pad_to_multiple_of=4) == 8
    assert target_length(8, seq_length=16, pad_to_seq_len=False, pad_to_multiple_of=4) == 8
    assert target_length(3, seq_length=16, pad_to_seq_len=False, pad_to_multiple_of=1) == 3
    assert target_length(0, seq_length=16, pad_to_seq_len=False, pad_to_multiple_of=8) == 0
    assert round_up(17, 16) == 32
    lens = np.array([0, 3, 8, 9])
    kw = {"seq_length": 16, "pad_to_multiple_of": 8}
    assert padded_lengths(lens, pad_to_seq_len=False, **kw).tolist() == [0, 8, 8, 16]
    assert padded_lengths(lens, pad_to_seq_len=True, **kw).tolist() == [16] * 4
    with pytest.raises(ValueError, match="a pack holds 17 tokens"):
        padded_lengths(np.array([17]), pad_to_seq_len=False, **kw)
    assert derive_pad_multiple() == 1
    assert derive_pad_multiple(context_parallel_size=2) == 4
    assert derive_pad_multiple(tensor_parallel_size=4, sequence_parallel=True) == 4
    assert derive_pad_multiple(tensor_parallel_size=4, sequence_parallel=False) == 1
    assert derive_pad_multiple(quantization_align=32) == 32
    assert derive_pad_multiple(context_parallel_size=3, quantization_align=32) == 96
    assert (
        derive_pad_multiple(
            context_parallel_size=3,
            tensor_parallel_size=4,
            sequence_parallel=True,
            quantization_align=16,
        )
        == 48
    )
    with pytest.raises(ValueError, match="quantization alignment must be >= 1"):
        derive_pad_multiple(quantization_align=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "zeros"}, "unknown --pad-policy 'zeros'"),
        ({"length": 2}, "cannot pad a pack of 3 tokens to length 2"),
        ({"doc_lens_B": np.array([2, 2])}, "sum to 4 but the pack has 3"),
        ({"doc_lens_B": np.array([3, 0])}, "every document needs >= 1 token"),
        ({"target_mask_N": np.ones(2)}, "loss-mask sidecar has 2 entries for 3 tokens"),
        ({"tokens_N": np.array([1.0, 2.0, 3.0])}, "must be integer arrays"),
    ],
)
def test_bad_pack_inputs(kwargs: dict, match: str) -> None:
    args = {"tokens_N": np.array([1, 2, 3]), "doc_lens_B": np.array([3]), "length": 5}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pad_pack(**args)


@pytest.mark.parametrize(
    "n, seq, multiple, match",
    [
        (1, 0, 1, "--seq-length must be >= 1"),
        (1, 8, 0, "--pad-to-multiple-of must be >= 1"),
        (9, 8, 1, "a pack holds 9 tokens"),
        (1, 10, 4, "--seq-length=10 is not a multiple of --pad-to-multiple-of=4"),
    ],
)
def test_bad_target_length(n: int, seq: int, multiple: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        target_length(n, seq_length=seq, pad_to_seq_len=False, pad_to_multiple_of=multiple)


def test_per_document_pads_cycle_their_own_document_inside_its_segment() -> None:
    # Documents [a b c] and [d e], CP 2 (every document to a multiple of 4), pack length 12.
    a, b, c, d, e = 10, 11, 12, 13, 14
    pack = pad_pack(np.array([a, b, c, d, e]), np.array([3, 2]), 12, doc_multiple=4)
    assert pack.tokens_S.tolist() == [a, b, c, a, d, e, d, e, a, b, c, d]
    assert pack.src_index_S.tolist() == [0, 1, 2, 0, 3, 4, 3, 4, 0, 1, 2, 3]
    assert pack.labels_S.tolist() == [b, c, X, X, e, X, X, X, X, X, X, X]
    assert pack.loss_mask_S.tolist() == [1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert pack.pad_mask_S.tolist() == [False] * 3 + [True] + [False] * 2 + [True] * 6
    # A document's pads stay in its segment (positions continue); the tail is its own segment.
    assert pack.cu_seqlens[: pack.num_segments + 1].tolist() == [0, 4, 8, 12]
    assert pack.position_ids_S.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    assert real_positions(np.array([3, 2]), 4).tolist() == [0, 1, 2, 4, 5]
    assert padded_doc_lengths(np.array([3, 2, 8]), 4).tolist() == [4, 4, 8]


def test_per_document_constant_and_multimodal_pads() -> None:
    pack = pad_pack(np.array([5, 6, 7]), np.array([1, 2]), 4, policy="constant", doc_multiple=2)
    assert pack.tokens_S.tolist() == [5, 0, 6, 7] and pack.src_index_S.tolist() == [0, -1, 1, 2]
    image = 99
    mm = pad_pack(
        np.array([5, image, 7]), np.array([3]), 4, placeholder_ids=[image], doc_multiple=4
    )
    assert mm.tokens_S.tolist() == [5, image, 7, 0] and mm.src_index_S[-1] == -1


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    cp=st.sampled_from([2, 4]),
    extra=st.integers(0, 8),
    policy=st.sampled_from(["self", "constant"]),
)
def test_per_document_padding_keeps_every_real_token_its_label_and_boundaries(
    lens: list[int], cp: int, extra: int, policy: str
) -> None:
    rng = np.random.default_rng(len(lens) * 31 + extra)
    doc_lens = np.array(lens)
    tokens = rng.integers(1, 1000, doc_lens.sum())
    body = int(padded_doc_lengths(doc_lens, 2 * cp).sum())
    length = body + 2 * cp * extra
    plain = pad_pack(tokens, doc_lens, int(doc_lens.sum()), policy=policy)
    pack = pad_pack(tokens, doc_lens, length, policy=policy, doc_multiple=2 * cp)
    real = real_positions(doc_lens, 2 * cp)
    # Real tokens, their labels and loss mask are the unpadded pack's, moved to their slots.
    assert np.array_equal(pack.tokens_S[real], tokens)
    assert np.array_equal(pack.labels_S[real], plain.labels_S)
    assert np.array_equal(pack.loss_mask_S[real], plain.loss_mask_S)
    assert not pack.pad_mask_S[real].any() and pack.pad_mask_S.sum() == length - tokens.size
    assert not pack.loss_mask_S[pack.pad_mask_S].any()
    # Every boundary is a multiple of 2*CP (TE's THD partitioning needs it), S included.
    bounds = pack.cu_seqlens[: pack.num_segments + 1]
    assert (bounds % (2 * cp) == 0).all() and bounds[-1] == length
    if policy == "self":  # each document's pads copy that document's own tokens
        starts = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)
        doc_of = np.searchsorted(np.cumsum(doc_lens), pack.src_index_S[:body], side="right")
        own = np.repeat(np.arange(doc_lens.size), padded_doc_lengths(doc_lens, 2 * cp))
        assert np.array_equal(doc_of, own) and starts.size == tokens.size


def test_the_cp_picture_in_docs_data_md() -> None:
    """docs/data.md's pack before slicing: documents [a b c] and [d e f g h], CP 2, S 16."""
    ids = {ch: i + 1 for i, ch in enumerate("abcdefgh")}
    tokens = np.array([ids[ch] for ch in "abcdefgh"])
    pack = pad_pack(tokens, np.array([3, 5]), 16, doc_multiple=4)
    names = {v: k for k, v in ids.items()}
    shown = "".join(
        names[t].upper() if pad else names[t]
        for t, pad in zip(pack.tokens_S, pack.pad_mask_S, strict=True)
    )
    assert shown == "abcAdefghDEFABCD"
    assert pack.cu_seqlens[: pack.num_segments + 1].tolist() == [0, 4, 12, 16]
    trained = [names[t] for t, m in zip(pack.tokens_S, pack.loss_mask_S, strict=True) if m]
    assert trained == list("abdefg")
    # After slicing: what each CP rank holds, by the stand-in of TE's per-document split.
    import torch

    from megatron_ext.common.thd_partition import thd_partitioned_indices

    cu = torch.tensor(pack.cu_seqlens[: pack.num_segments + 1], dtype=torch.int32)
    held = [
        "".join(shown[i] for i in thd_partitioned_indices(cu, 16, 2, r).tolist()) for r in (0, 1)
    ]
    assert held == ["aAdeEFAD", "bcfghDBC"]
