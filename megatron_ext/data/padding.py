"""Self-token padding of packed sequences (pure numpy; never imports megatron).

Pads copy the pack's own tokens, cycled from its first real token, so they route like real text
instead of sending one constant id's whole run to one expert; they stay loss-masked, in their own
segment after every real token. Documents ``[a b c]`` and ``[d e]`` padded to 8 (docs/data.md has
the labels, the loss mask and the CP layout)::

    tokens_S      = [a  b  c  d  e  a  b  c ]
    src_index_S   = [0  1  2  3  4  0  1  2 ]     real index each position holds or copies
    pad_mask_S    = [F  F  F  F  F  T  T  T ]     True = pad (Megatron's MoE padding_mask)
    cu_seqlens    = [0  3  5  8  8  8  8  8  8]   fixed length S+1, trailing entries = S

Legend: N real tokens, B documents, S padded pack length, W per-token payload width.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

PadPolicy = Literal["self", "constant"]
PAD_POLICIES: tuple[str, ...] = ("self", "constant")

#: Label written wherever there is nothing to predict (pads, the last token of each document).
#: Masked by ``loss_mask`` (never by comparing ids) and ignored by Megatron's cross entropy.
IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class PaddedPack:
    """One pack padded to its target length (all arrays numpy, length S unless stated)."""

    tokens_S: np.ndarray
    """int64 input ids: the real tokens, then the pads."""
    labels_S: np.ndarray
    """int64 next-token targets inside each document, IGNORE_INDEX elsewhere."""
    loss_mask_S: np.ndarray
    """float32, 1 where the label is a training target; always 0 on pads."""
    position_ids_S: np.ndarray
    """int64 positions, restarting at 0 in each document and in the pad segment."""
    pad_mask_S: np.ndarray
    """bool, True = pad (Megatron's ``padding_mask`` convention)."""
    src_index_S: np.ndarray
    """int64 index into the pack's real tokens that each position holds or copies; -1 = none."""
    cu_seqlens: np.ndarray
    """int32 [S + 1] segment boundaries (documents, then the pad segment), trailing entries = S."""
    num_segments: int
    """Number of real entries in ``cu_seqlens`` minus one (documents plus a pad segment if any)."""
    max_seqlen: int
    """Longest segment (0 for an empty pack)."""


def round_up(n: int, multiple: int) -> int:
    """Returns the smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def target_length(
    num_tokens: int, *, seq_length: int, pad_to_seq_len: bool, pad_to_multiple_of: int
) -> int:
    """Length S a pack of ``num_tokens`` real tokens is padded to: ``seq_length`` with
    ``pad_to_seq_len``, else the next multiple of ``pad_to_multiple_of`` (ValueError for a
    multiple that would push a full pack past ``seq_length``)."""
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"--pad-to-multiple-of must be >= 1, got {pad_to_multiple_of}")
    if not 0 <= num_tokens <= seq_length:
        raise ValueError(f"a pack holds {num_tokens} tokens, outside 0..--seq-length={seq_length}")
    if pad_to_seq_len:
        return seq_length
    if seq_length % pad_to_multiple_of:
        raise ValueError(
            f"--seq-length={seq_length} is not a multiple of "
            f"--pad-to-multiple-of={pad_to_multiple_of}: a full pack could not be padded"
        )
    return round_up(num_tokens, pad_to_multiple_of)


def padded_lengths(
    pack_lens_P: np.ndarray,
    *,
    seq_length: int,
    pad_to_seq_len: bool,
    pad_to_multiple_of: int,
) -> np.ndarray:
    """Vectorised :func:`target_length` over packs (for statistics and benchmarks)."""
    pack_lens_P = np.asarray(pack_lens_P, dtype=np.int64)
    for n in (pack_lens_P.min(initial=0), pack_lens_P.max(initial=0)):
        target_length(
            int(n),
            seq_length=seq_length,
            pad_to_seq_len=pad_to_seq_len,
            pad_to_multiple_of=pad_to_multiple_of,
        )
    if pad_to_seq_len:
        return np.full_like(pack_lens_P, seq_length)
    return -(-pack_lens_P // pad_to_multiple_of) * pad_to_multiple_of


def derive_pad_multiple(
    *,
    context_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    quantization_align: int = 1,
) -> int:
    """Smallest pack-length multiple the run needs: the lcm of those that apply, 1 if none.

    Example: ``derive_pad_multiple(context_parallel_size=3, quantization_align=32) == 96``.

    Raises:
        ValueError: ``quantization_align`` < 1.
    """
    if quantization_align < 1:
        raise ValueError(f"quantization alignment must be >= 1, got {quantization_align}")
    # The pack length is the M dimension of the run's fp8/fp4 GEMMs: Megatron's
    # get_fp8_align_size / get_fp4_align_size (fp8 16, mxfp8 32, nvfp4 128; 1 in bf16), read by
    # quantization_align.quantization_align_from_args so this module never imports megatron.
    multiple = quantization_align
    if context_parallel_size > 1:  # each CP rank takes two load-balanced chunks
        multiple = math.lcm(multiple, 2 * context_parallel_size)
    if sequence_parallel and tensor_parallel_size > 1:  # the sequence is split across TP ranks
        multiple = math.lcm(multiple, tensor_parallel_size)
    return multiple


def check_pad_policy(policy: str) -> None:
    """ValueError naming ``--pad-policy`` for a policy :func:`pad_pack` does not know."""
    if policy not in PAD_POLICIES:
        raise ValueError(f"unknown --pad-policy {policy!r}; choose one of {PAD_POLICIES}")


def _check_pack_inputs(
    tokens_N: np.ndarray,
    doc_lens_B: np.ndarray,
    target_mask_N: np.ndarray | None,
    policy: str,
) -> None:
    check_pad_policy(policy)
    if tokens_N.ndim != 1 or doc_lens_B.ndim != 1:
        raise ValueError("tokens and document lengths must be 1-D")
    if not np.issubdtype(tokens_N.dtype, np.integer) or not np.issubdtype(
        doc_lens_B.dtype, np.integer
    ):
        raise ValueError("tokens and document lengths must be integer arrays")
    if doc_lens_B.size and doc_lens_B.min() < 1:
        raise ValueError(f"every document needs >= 1 token, got lengths {doc_lens_B.tolist()}")
    if int(doc_lens_B.sum()) != tokens_N.size:
        raise ValueError(
            f"document lengths sum to {int(doc_lens_B.sum())} but the pack has "
            f"{tokens_N.size} tokens"
        )
    if target_mask_N is not None and target_mask_N.shape != tokens_N.shape:
        raise ValueError(
            f"loss-mask sidecar has {target_mask_N.size} entries for {tokens_N.size} tokens"
        )


def padded_doc_lengths(doc_lens_B: np.ndarray, doc_multiple: int = 1) -> np.ndarray:
    """Each document's length once padded to a multiple of ``doc_multiple`` (its slot in a pack).

    Example: ``padded_doc_lengths([3, 4, 5], 4) -> [4, 4, 8]``.
    """
    if doc_multiple < 1:
        raise ValueError(f"the per-document pad multiple must be >= 1, got {doc_multiple}")
    doc_lens_B = np.asarray(doc_lens_B, dtype=np.int64)
    return -(-doc_lens_B // doc_multiple) * doc_multiple


def real_positions(doc_lens_B: np.ndarray, doc_multiple: int = 1) -> np.ndarray:
    """int64 [N]: the pack position of each real token (documents in order, each in its slot).

    Example: documents [3, 2], ``doc_multiple`` 4 -> [0, 1, 2, 4, 5].
    """
    doc_lens_B = np.asarray(doc_lens_B, dtype=np.int64)
    slots_B = padded_doc_lengths(doc_lens_B, doc_multiple)
    shift_B = np.cumsum(slots_B - doc_lens_B) - (slots_B - doc_lens_B)  # pads before each doc
    return np.arange(int(doc_lens_B.sum()), dtype=np.int64) + np.repeat(shift_B, doc_lens_B)


def pad_pack(
    tokens_N: np.ndarray,
    doc_lens_B: np.ndarray,
    length: int,
    *,
    policy: PadPolicy = "self",
    pad_id: int = 0,
    placeholder_ids: Sequence[int] = (),
    target_mask_N: np.ndarray | None = None,
    doc_multiple: int = 1,
) -> PaddedPack:
    """Pads one pack of whole documents to ``length`` tokens.

    Args:
        tokens_N: The pack's real tokens, documents concatenated.
        doc_lens_B: Length of each document (each >= 1, summing to N).
        length: Target length S >= the padded documents' total (see :func:`target_length`).
        policy: ``"self"`` cycles the pack's own tokens; ``"constant"`` writes ``pad_id``.
        pad_id: Id of a constant pad (``policy="constant"``, multimodal packs, empty packs).
        placeholder_ids: Multimodal placeholder ids; a pack holding one pads with ``pad_id``.
        target_mask_N: Per-token training-target mask (0 = e.g. a prompt token); None = all 1.
        doc_multiple: Pad every document to a multiple of this first (2*CP under CP).

    Raises:
        ValueError: On an unknown policy, inconsistent lengths or ``length`` too short.
    """
    tokens_N, doc_lens_B = np.asarray(tokens_N), np.asarray(doc_lens_B)
    _check_pack_inputs(tokens_N, doc_lens_B, target_mask_N, policy)
    n = tokens_N.size
    doc_lens_B = doc_lens_B.astype(np.int64)
    slots_B = padded_doc_lengths(doc_lens_B, doc_multiple)
    body = int(slots_B.sum())
    if length < body:
        what = f"{n} tokens" if body == n else f"{n} tokens ({body} with per-document pads)"
        raise ValueError(f"cannot pad a pack of {what} to length {length}")

    # Pads never copy a placeholder: a multimodal pack (or an empty one, which has nothing to
    # copy) pads with the constant id.
    is_multimodal = bool(np.isin(tokens_N, np.asarray(placeholder_ids, dtype=np.int64)).any())
    copy_pads = policy == "self" and not is_multimodal and n > 0
    src_index_S = _source_index(doc_lens_B, slots_B, length, copy_pads)
    real_S = real_positions(doc_lens_B, doc_multiple)
    pad_mask_S = np.ones(length, dtype=bool)
    pad_mask_S[real_S] = False
    tokens_S = np.full(length, pad_id, dtype=np.int64)
    tokens_S[src_index_S >= 0] = tokens_N[src_index_S[src_index_S >= 0]]

    seg_lens, cu_seqlens, position_ids_S = _segments(slots_B, length)
    labels_S, loss_mask_S = _labels(tokens_N, doc_lens_B, real_S, length, target_mask_N)
    return PaddedPack(
        tokens_S=tokens_S,
        labels_S=labels_S,
        loss_mask_S=loss_mask_S,
        position_ids_S=position_ids_S,
        pad_mask_S=pad_mask_S,
        src_index_S=src_index_S,
        cu_seqlens=cu_seqlens,
        num_segments=int(seg_lens.size),
        max_seqlen=int(seg_lens.max()) if seg_lens.size else 0,
    )


def _segments(slots_B: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment lengths, ``cu_seqlens`` [S + 1] and ``position_ids_S`` of a pack's slots."""
    # One segment per document slot, then one for the tail pads, so no real token attends to a
    # pad. Under CP a document's own pads stay in its slot after its last real token, where
    # Megatron's SFTDataset places its CP pads (causal: no real token sees them), so every
    # boundary is a multiple of 2*CP, as TE's THD partitioning needs.
    tail = length - int(slots_B.sum())
    seg_lens = np.concatenate([slots_B, [tail] if tail else []]).astype(np.int64)
    cu_seqlens = np.full(length + 1, length, dtype=np.int32)  # fixed length: samples collate
    cu_seqlens[0] = 0
    cu_seqlens[1 : seg_lens.size + 1] = np.cumsum(seg_lens)
    seg_starts = np.repeat(np.cumsum(seg_lens) - seg_lens, seg_lens)
    return seg_lens, cu_seqlens, np.arange(length, dtype=np.int64) - seg_starts


def _source_index(
    doc_lens_B: np.ndarray, slots_B: np.ndarray, length: int, copy_pads: bool
) -> np.ndarray:
    """``src_index_S``: the real index each position holds or copies (-1 = a constant pad)."""
    n, body = int(doc_lens_B.sum()), int(slots_B.sum())
    doc_starts_B = np.cumsum(doc_lens_B) - doc_lens_B
    offset_in_slot = np.arange(body, dtype=np.int64) - np.repeat(
        np.cumsum(slots_B) - slots_B, slots_B
    )
    doc_of_slot = np.repeat(np.arange(doc_lens_B.size), slots_B)
    within = offset_in_slot < doc_lens_B[doc_of_slot]
    src_index_S = np.full(length, -1, dtype=np.int64)
    if copy_pads:
        # A document's own pads cycle that document from its first token (they stay in its
        # segment, so they copy nothing from another document); the tail pads cycle the whole
        # pack from its first real token.
        src_index_S[:body] = doc_starts_B[doc_of_slot] + offset_in_slot % doc_lens_B[doc_of_slot]
        src_index_S[body:] = np.arange(length - body) % n
    else:
        src_index_S[:body] = np.where(within, doc_starts_B[doc_of_slot] + offset_in_slot, -1)
    return src_index_S


def _labels(
    tokens_N: np.ndarray,
    doc_lens_B: np.ndarray,
    real_N: np.ndarray,
    length: int,
    target_mask_N: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Labels and loss mask by position: real token i predicts token i+1 when i+1 is in the same
    document; pads predict nothing."""
    # Never derived from ids (Megatron masks labels == pad id), so pad_id == eos is safe.
    n = tokens_N.size
    doc_starts_B = np.cumsum(doc_lens_B) - doc_lens_B
    has_next_N = np.ones(n, dtype=bool)
    has_next_N[doc_starts_B[1:] - 1] = False
    if n:
        has_next_N[-1] = False
    next_N = np.minimum(np.arange(n) + 1, max(n - 1, 0))
    labels_S = np.full(length, IGNORE_INDEX, dtype=np.int64)
    labels_S[real_N] = np.where(has_next_N, tokens_N[next_N], IGNORE_INDEX)
    loss_mask_S = np.zeros(length, dtype=np.float32)
    loss_mask_S[real_N] = has_next_N
    if target_mask_N is not None and n:  # a target's mask is read at the token it predicts
        loss_mask_S[real_N] *= np.asarray(target_mask_N, dtype=np.float32)[next_N]
    return labels_S, loss_mask_S


def check_fill(fill: int, dtype: np.dtype | type, what: str) -> None:
    """Raises ValueError naming ``what`` unless ``fill`` is representable in ``dtype``.

    Example: ``check_fill(-1, np.uint8, "routes sidecar")`` raises (uint8 holds 0..255), where
    numpy itself would only raise a bare OverflowError at the first constant pad.
    """
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        ok = fill in (0, 1)
    elif np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        ok = float(fill).is_integer() and info.min <= fill <= info.max
    else:  # a float fill must not overflow to inf (e.g. 1e6 in float16)
        with np.errstate(over="ignore"):
            ok = bool(np.isfinite(dtype.type(fill))) or not np.isfinite(fill)
    if not ok:
        raise ValueError(
            f"{what} holds {dtype.name} values but its constant-pad fill is {fill!r}, which "
            f"{dtype.name} cannot represent; pick a fill inside the dtype's range"
        )


def gather_by_src_index(values_NW: np.ndarray, src_index_S: np.ndarray, fill: int) -> np.ndarray:
    """Pads any per-token payload exactly like the tokens: ``values_NW[src_index_S]``.

    Route replay relies on it: a self pad carries the routes (or loss weights) of the token it
    copies, a constant pad (``src_index_S == -1``) gets ``fill``, which must fit the dtype.

    Args:
        values_NW: Payload of the pack's N real tokens, [N] or [N, W] (e.g. W = layers * topk).
        src_index_S: From :attr:`PaddedPack.src_index_S`.
        fill: Value for constant pads (:func:`check_fill`).
    """
    values_NW = np.asarray(values_NW)
    check_fill(fill, values_NW.dtype, "payload")
    if src_index_S.size and src_index_S.max(initial=-1) >= values_NW.shape[0]:
        raise ValueError(
            f"payload has {values_NW.shape[0]} rows but the pack indexes row "
            f"{int(src_index_S.max())}"
        )
    if values_NW.shape[0] == 0:  # nothing to copy: every position must be a constant pad
        return np.full((src_index_S.size, *values_NW.shape[1:]), fill, dtype=values_NW.dtype)
    out = values_NW[np.maximum(src_index_S, 0)]
    out[src_index_S < 0] = fill
    return out
