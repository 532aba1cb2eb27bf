"""Route buffers for route replay (R3): compact ``[tokens, moe_layers, topk]`` expert ids.

In MoE RL the inference engine that generated a rollout chose experts for every token at every MoE
layer. Replaying those choices in the training forward (R3) removes the train/inference routing
mismatch. This module is the pure part of that feature (numpy only, never imports megatron): the
storage format, validation, padding consistent with self-token padding, the policy for positions
that have no recorded route, and vLLM's ``T - 1`` off-by-one.

Format. ``routes_TLK`` holds expert ids as ``uint8`` when they fit (<= 256 experts) and ``uint16``
otherwise, so a route costs K bytes per token per MoE layer. A row (one token at one layer) whose
K entries all equal the dtype's maximum (``0xFF`` / ``0xFFFF``) is *missing*: no route was
recorded there (vLLM's final token, tool tokens, constant-id pads). A real row has K distinct ids,
so an all-max row is unambiguous whenever K >= 2; with K == 1 and exactly 256 experts id 255 would
collide, so that case uses uint16 (:func:`route_dtype`).

Padding. The data blender's self-token padding returns ``src_index_S``: for each output position
the index of the real token it holds or copies, ``-1`` for a constant-id pad. Routes are padded
with the same index, so a pad replays the route of the token it copies::

    tokens  [a b c]      src_index_S [0 1 2 0 1]   ->  tokens [a b c a b]
    routes  [ra rb rc]                             ->  routes [ra rb rc ra rb]
    src_index_S [0 1 2 -1 -1]                      ->  routes [ra rb rc -- --]   (-- missing)

Missing rows. ``native`` leaves them missing: the router decides those rows at train time.
``balanced`` fills them here with distinct top-k spread so that, for every EP size P dividing the
expert count (ranks own contiguous blocks of E / P experts), the number of filled (row, slot)
assignments per EP rank differs by at most one. Construction: the m filled slots of a layer are
``m // E`` full cycles over all experts plus ``r = m % E`` experts at evenly spaced points
``floor(c + j * E / r)``; any interval of E / P consecutive experts contains ``floor(r / P)`` or
``ceil(r / P)`` of those points, for every P at once. The offset ``c`` comes from a golden-ratio
(Kronecker) sequence over ``layer + seed``, where the caller passes something that differs per
pack (the pack index): packs with the same number of missing rows then pick different experts, so
a micro-batch of packs stays balanced too (a layer-only phase sent one missing row per pack to
experts 0 and 4 in every pack).

Legend: T tokens (rows of a route buffer), S positions of a padded pack, L MoE layers, K top-k,
E experts, M missing rows of one layer.
"""

import math

import numpy as np

from megatron_ext.replay.route_file import BLOCK_VALUES, first_invalid_row

#: The missing-route policies. ``native``: the router decides rows with no route;
#: ``balanced``: such rows get a synthetic, EP-balanced, distinct top-k.
MISSING_ROUTE_POLICIES = ("native", "balanced")

# Phase step between layers (and packs) of the balanced fill: the golden ratio's fractional part,
# so consecutive layers and packs place their r evenly spaced experts at well-spread offsets.
_LAYER_PHASE_STEP = (math.sqrt(5.0) - 1.0) / 2.0


def route_dtype(num_experts: int, topk: int) -> np.dtype:
    """Returns the narrowest dtype that holds expert ids plus the missing-row marker.

    Args:
        num_experts: E, the number of routed experts per MoE layer.
        topk: K, experts per token.

    Returns:
        ``uint8`` for E <= 256 (E <= 255 when K == 1), else ``uint16``.

    Raises:
        ValueError: E or K out of range (E > 65535, K > E, non-positive values).
    """
    if num_experts < 1 or topk < 1:
        raise ValueError(f"num_experts ({num_experts}) and topk ({topk}) must be positive")
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) exceeds num_experts ({num_experts})")
    if num_experts <= 255 or (num_experts == 256 and topk >= 2):
        return np.dtype(np.uint8)
    if num_experts <= 65535:
        return np.dtype(np.uint16)
    raise ValueError(f"num_experts ({num_experts}) exceeds the uint16 route format (65535)")


def missing_value(dtype: np.dtype) -> int:
    """The id that marks a missing row when it fills all K entries: the dtype's maximum."""
    return int(np.iinfo(dtype).max)


def missing_routes(num_tokens: int, num_layers: int, topk: int, dtype: np.dtype) -> np.ndarray:
    """An all-missing route buffer ``[num_tokens, num_layers, topk]``."""
    return np.full((num_tokens, num_layers, topk), missing_value(dtype), dtype=dtype)


def missing_mask(routes_TLK: np.ndarray) -> np.ndarray:
    """Returns ``missing_TL``: True where the row holds no recorded route.

    Built slot by slot into one ``[T, L]`` array (temporaries ``2 T L`` bools, i.e. ``2 / K`` of
    a uint8 buffer), not through a ``[T, L, K]`` comparison.
    """
    marker = missing_value(routes_TLK.dtype)
    missing_TL = routes_TLK[..., 0] == marker
    for k in range(1, routes_TLK.shape[-1]):
        np.logical_and(missing_TL, routes_TLK[..., k] == marker, out=missing_TL)
    return missing_TL


def count_missing_rows(routes_TLK: np.ndarray, block_rows: int = 4096) -> int:
    """The number of missing (token, layer) rows, counted in blocks of ``block_rows`` tokens
    (temporaries bounded by the block, whatever the buffer's size)."""
    return sum(
        int(np.count_nonzero(missing_mask(routes_TLK[start : start + block_rows])))
        for start in range(0, routes_TLK.shape[0], block_rows)
    )


def validate_routes(
    routes_TLK: np.ndarray,
    *,
    num_layers: int,
    num_experts: int,
    topk: int,
    name: str = "routes",
    token_offset: int = 0,
) -> None:
    """Checks shape, dtype, id range and distinctness; errors name the layer and token.

    Missing rows (all entries at the dtype maximum) are allowed; a row mixing the marker with
    real ids is not.

    Args:
        routes_TLK: The route buffer.
        num_layers: Expected L (MoE layers of the model, MTP excluded).
        num_experts: E; every id must be < E.
        topk: Expected K.
        name: What the buffer is (a file, a document) for error messages.
        token_offset: Added to token numbers in error messages (position of row 0 in a file).

    Raises:
        ValueError: On the first problem found, naming layer and token.
    """
    if routes_TLK.ndim != 3:
        raise ValueError(
            f"{name}: expected [tokens, moe_layers, topk], got shape {routes_TLK.shape}"
        )
    if routes_TLK.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"{name}: route dtype must be uint8 or uint16, got {routes_TLK.dtype}")
    _, n_layers, k = routes_TLK.shape
    if n_layers != num_layers:
        raise ValueError(f"{name}: has {n_layers} MoE layers, the model has {num_layers}")
    if k != topk:
        raise ValueError(f"{name}: has top-k {k}, the model routes to {topk} experts (topk)")
    if routes_TLK.shape[0] == 0 or k == 0:  # K == 0: every row is (vacuously) missing
        return
    # In blocks, temporaries bounded by the block whatever the buffer's size: the dataset's
    # whole-file check names the first bad row (token-major) and the worst rule it breaks.
    bad = first_invalid_row(routes_TLK, num_experts)
    if bad is None:
        return
    token, layer, what = bad
    # The errors are rule-major: a row mixing the marker anywhere is named before any id out of
    # range, which is named before any duplicate. Rows before the first bad one are valid, so a
    # row breaking a higher-ranked rule can only come at or after it.
    later = _first_partial_or_too_big(routes_TLK[token:], num_experts)
    if later is not None:
        token, layer, what = token + later[0], later[1], later[2]
    raise ValueError(f"{name}: token {token + token_offset}, MoE layer {layer} {what}")


def _first_partial_or_too_big(
    routes_TLK: np.ndarray, num_experts: int
) -> tuple[int, int, str] | None:
    """``(token, layer, what)`` of the first row mixing the marker with real ids, else of the
    first row holding an id >= E, else None.

    In blocks of :data:`~megatron_ext.replay.route_file.BLOCK_VALUES` values, slot by slot
    (``[rows, L]`` temporaries only); ``what`` is worded as ``first_invalid_row`` words it.
    """
    num_rows, num_layers, topk = routes_TLK.shape
    marker = missing_value(routes_TLK.dtype)
    block = max(1, BLOCK_VALUES // max(num_layers * topk, 1))
    too_big = None
    for start in range(0, num_rows, block):
        slots = [routes_TLK[start : start + block, :, k] for k in range(topk)]  # strided views
        any_marker_TL = slots[0] == marker
        all_marker_TL = any_marker_TL.copy()
        too_big_TL = (slots[0] >= num_experts) & ~any_marker_TL  # the marker is not an id
        for slot in slots[1:]:
            is_marker = slot == marker
            np.logical_or(any_marker_TL, is_marker, out=any_marker_TL)
            np.logical_and(all_marker_TL, is_marker, out=all_marker_TL)
            np.logical_or(too_big_TL, (slot >= num_experts) & ~is_marker, out=too_big_TL)
        partial_TL = any_marker_TL & ~all_marker_TL
        if num_experts <= marker and partial_TL.any():  # 256 uint8 experts: 255 is an id
            row, layer = divmod(int(np.flatnonzero(partial_TL)[0]), num_layers)
            return start + row, layer, "mixes the missing-row marker with real ids"
        if too_big is None and too_big_TL.any():
            row, layer = divmod(int(np.flatnonzero(too_big_TL)[0]), num_layers)
            too_big = (start + row, layer, f"has an expert id >= num_experts ({num_experts})")
    return too_big


def pad_routes(routes_TLK: np.ndarray, src_index_S: np.ndarray) -> np.ndarray:
    """Pads routes exactly as self-token padding pads tokens: ``routes_SLK = routes[src_index]``.

    Args:
        routes_TLK: Routes of the T real tokens of a pack.
        src_index_S: For each output position, the real token it holds or copies; -1 for a
            constant-id pad, which gets a missing row.

    Returns:
        ``routes_SLK`` with the dtype of ``routes_TLK``.

    Raises:
        ValueError: An index outside ``[-1, T)``.
    """
    src_index_S = np.asarray(src_index_S)
    num_tokens = routes_TLK.shape[0]
    if src_index_S.size and (src_index_S.min() < -1 or src_index_S.max() >= num_tokens):
        raise ValueError(
            f"src_index_S must lie in [-1, {num_tokens}) for {num_tokens} routed tokens, "
            f"got range [{src_index_S.min()}, {src_index_S.max()}]"
        )
    routes_SLK = (
        routes_TLK[np.clip(src_index_S, 0, None)]
        if num_tokens
        else np.empty((src_index_S.size,) + routes_TLK.shape[1:], dtype=routes_TLK.dtype)
    )
    routes_SLK[src_index_S < 0] = missing_value(routes_TLK.dtype)
    return routes_SLK


def balanced_experts(num_slots: int, num_experts: int, phase: float = 0.0) -> np.ndarray:
    """A sequence of ``num_slots`` expert ids balanced over every EP size dividing E.

    Any K <= E consecutive entries are distinct, and for every P dividing E the count per EP rank
    (contiguous blocks of E / P experts) differs by at most one.

    Args:
        num_slots: m, how many (row, slot) assignments to make.
        num_experts: E.
        phase: In [0, 1): shifts the evenly spaced remainder points within their spacing.

    Returns:
        ``experts_m`` (int64).
    """
    cycles, rem = divmod(num_slots, num_experts)
    if rem == 0:
        order_E = np.arange(num_experts)
    else:
        # r evenly spaced points floor((c + j*E) / r), offset c / r < E / r; integer division keeps
        # the floors exact, and the spacing E / r > 1 keeps the points distinct.
        offset = int(phase * num_experts) % num_experts
        chosen_r = (np.arange(rem, dtype=np.int64) * num_experts + offset) // rem
        rest = np.ones(num_experts, dtype=bool)
        rest[chosen_r] = False
        order_E = np.concatenate([chosen_r, np.flatnonzero(rest)])
    # A prefix of a periodic permutation: any window of K <= E entries is distinct.
    return np.concatenate([np.tile(order_E, cycles), order_E[:rem]])


def fill_missing_balanced(
    routes_TLK: np.ndarray,
    num_experts: int,
    seed: int = 0,
    src_index_T: np.ndarray | None = None,
) -> np.ndarray:
    """Fills every missing row with a distinct top-k, EP-balanced per layer (policy ``balanced``).

    Example (E = 8, K = 2, three missing rows at one layer): the 6 slots are 8 // 8 = 0 cycles
    plus 6 evenly spaced experts ``[0 1 2 4 5 6]`` -> rows ``[0 1] [2 4] [5 6]``; at EP = 2 the
    ranks get 3 and 3, at EP = 4 they get 2, 1, 2, 1.

    A padded pack passes its ``src_index_T``: a self pad then replays exactly what its source
    replays. The fill is made over the rows that hold their own token (``src_index_T[t] == t``)
    and the constant pads (``-1``), and each copy takes its source's row::

        routes      [ra -- rc | -- -- ]     src_index_T [0 1 2 1 -1]
        filled      [ra f1 rc | f1 f2 ]     (the pad at 3 copies token 1: f1, not a fill of its own)

    Args:
        routes_TLK: Route buffer, possibly with missing rows.
        num_experts: E.
        seed: Differs per pack (e.g. the pack index) so that packs with equally many missing
            rows spread over different experts; 0 gives the example above.
        src_index_T: Optional, for a padded pack: the row each row holds or copies (-1: none),
            as :mod:`megatron_ext.data.padding` returns it.

    Returns:
        A copy with no missing rows.

    Raises:
        ValueError: ``src_index_T`` does not fit the buffer or a copy's source is itself a copy.
    """
    routes_TLK = routes_TLK.copy()
    own_T = _own_rows(src_index_T, routes_TLK.shape[0])
    missing_TL = missing_mask(routes_TLK) & own_T[:, None]
    topk = routes_TLK.shape[2]
    for layer in range(routes_TLK.shape[1]):
        rows_M = np.flatnonzero(missing_TL[:, layer])
        if rows_M.size == 0:
            continue
        phase = ((layer + seed) * _LAYER_PHASE_STEP) % 1.0
        experts = balanced_experts(rows_M.size * topk, num_experts, phase)
        routes_TLK[rows_M, layer] = experts.reshape(rows_M.size, topk).astype(routes_TLK.dtype)
    if src_index_T is not None:
        copies_C = np.flatnonzero(~own_T)
        routes_TLK[copies_C] = routes_TLK[src_index_T[copies_C]]
    return routes_TLK


def _own_rows(src_index_T: np.ndarray | None, num_rows: int) -> np.ndarray:
    """Rows that hold their own token or copy nothing (all rows without ``src_index_T``)."""
    if src_index_T is None:
        return np.ones(num_rows, dtype=bool)
    src_index_T = np.asarray(src_index_T)
    if src_index_T.shape != (num_rows,) or not np.issubdtype(src_index_T.dtype, np.integer):
        raise ValueError(
            f"src_index has shape {src_index_T.shape} ({src_index_T.dtype}) for {num_rows} route "
            "rows; expected one integer per row"
        )
    if num_rows and (src_index_T.min() < -1 or src_index_T.max() >= num_rows):
        raise ValueError(f"src_index holds values outside [-1, {num_rows})")
    own_T = (src_index_T < 0) | (src_index_T == np.arange(num_rows))
    copies_C = np.flatnonzero(~own_T)
    bad = copies_C[~own_T[src_index_T[copies_C]]]
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"src_index: row {row} copies row {int(src_index_T[row])}, which is itself a copy"
        )
    return own_T


def apply_missing_policy(
    routes_TLK: np.ndarray,
    policy: str,
    num_experts: int,
    seed: int = 0,
    src_index_T: np.ndarray | None = None,
) -> np.ndarray:
    """Applies ``--replay-missing-route-policy`` at data time.

    ``native`` returns the buffer unchanged (rows stay missing, a pad's copy of a missing row
    too; the router decides them in the forward). ``balanced`` fills
    them with :func:`fill_missing_balanced` (``seed``: the pack or document index;
    ``src_index_T``: a padded pack's, so a self pad replays its source's fill; see there).

    Raises:
        ValueError: An unknown policy.
    """
    if policy == "native":
        return routes_TLK
    if policy == "balanced":
        return fill_missing_balanced(routes_TLK, num_experts, seed, src_index_T)
    raise ValueError(
        f"--replay-missing-route-policy must be one of {MISSING_ROUTE_POLICIES}, got {policy!r}"
    )


def reconcile_t_minus_1(
    routes_TLK: np.ndarray, num_tokens: int, name: str = "routes"
) -> np.ndarray:
    """Reconciles vLLM-style routes (T - 1 rows for T tokens) with the token count.

    vLLM and Megatron inference return routes for the tokens that were fed through the model, which
    is every token but the last sampled one. The last row is appended as missing, so the missing
    policy decides it rather than a zero row that would send it to expert 0.

    Args:
        routes_TLK: ``num_tokens - 1`` (or already ``num_tokens``) rows.
        num_tokens: T, the token count of the sample.
        name: For the error message.

    Returns:
        ``[num_tokens, L, K]``.

    Raises:
        ValueError: Any other row count.
    """
    rows = routes_TLK.shape[0]
    if rows == num_tokens:
        return routes_TLK
    if rows == num_tokens - 1:
        tail = missing_routes(1, routes_TLK.shape[1], routes_TLK.shape[2], routes_TLK.dtype)
        return np.concatenate([routes_TLK, tail])
    raise ValueError(
        f"{name}: {rows} route rows for {num_tokens} tokens; expected {num_tokens} "
        f"or {num_tokens - 1} (vLLM's T-1)"
    )


def rank_counts(experts: np.ndarray, num_experts: int, ep_size: int) -> np.ndarray:
    """Counts ids per EP rank, ranks owning contiguous blocks of ``E / ep_size`` experts.

    Raises:
        ValueError: ``ep_size`` does not divide E.
    """
    if num_experts % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide num_experts ({num_experts})")
    ranks = np.asarray(experts, dtype=np.int64).reshape(-1) // (num_experts // ep_size)
    return np.bincount(ranks, minlength=ep_size)
