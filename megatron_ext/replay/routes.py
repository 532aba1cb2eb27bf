"""Route buffers for route replay (R3): compact ``[tokens, moe_layers, topk]`` expert ids (pure
numpy, never imports megatron).

The storage format (uint8 ids up to 256 experts, else uint16; a row whose K entries all equal the
dtype's maximum is *missing*: no route recorded), validation, vLLM's ``T - 1`` off-by-one, the
policy for missing rows, and padding by self-token padding's ``src_index_S``, so a pad replays
the route of the token it copies::

    tokens  [a b c]      src_index_S [0 1 2 0 1]   ->  tokens [a b c a b]
    routes  [ra rb rc]                             ->  routes [ra rb rc ra rb]
    src_index_S [0 1 2 -1 -1]                      ->  routes [ra rb rc -- --]   (-- missing)

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
    """The narrowest dtype that holds E expert ids plus the missing-row marker: ``uint8`` for
    E <= 256 (E <= 255 when K == 1), else ``uint16``; ValueError for E or K out of range."""
    if num_experts < 1 or topk < 1:
        raise ValueError(f"num_experts ({num_experts}) and topk ({topk}) must be positive")
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) exceeds num_experts ({num_experts})")
    # A real row has K distinct ids, so an all-max row is unambiguous when K >= 2; with K == 1
    # and 256 experts, id 255 would be the marker.
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
    """Returns ``missing_TL``: True where the row holds no recorded route."""
    # Slot by slot into one [T, L] array (temporaries 2 T L bools, 2 / K of a uint8 buffer), not
    # through a [T, L, K] comparison.
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
    """Checks shape, dtype, id range and distinctness (ValueError naming the layer and token).

    Missing rows are allowed; a row mixing the marker with real ids is not. ``name`` (a file, a
    document) and ``token_offset`` (row 0's position in a file) are for the messages.
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
    first row holding an id >= E, else None (``what`` worded as ``first_invalid_row`` words it)."""
    # In blocks of BLOCK_VALUES values, slot by slot: [rows, L] temporaries only.
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
    """Pads routes exactly as self-token padding pads tokens: ``routes_SLK = routes[src_index]``;
    a constant pad (-1) gets a missing row. ValueError for an index outside ``[-1, T)``."""
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
    """``experts_m`` (int64): ``num_slots`` expert ids balanced over every EP size dividing E.

    Any K <= E consecutive entries are distinct, and for every P dividing E the count per EP rank
    (contiguous blocks of E / P experts) differs by at most one. ``phase`` in [0, 1) shifts the
    evenly spaced remainder points within their spacing.
    """
    # m slots are m // E full cycles over all experts plus r = m % E experts at evenly spaced
    # points floor(c + j * E / r): any interval of E / P consecutive experts holds floor(r / P)
    # or ceil(r / P) of them, for every P at once.
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

    Example (E = 8, K = 2, three missing rows at one layer, seed 0): the 6 slots are 6 evenly
    spaced experts ``[0 1 2 4 5 6]`` -> rows ``[0 1] [2 4] [5 6]``; EP 2 gets 3 and 3, EP 4 2, 1,
    2, 1. With a padded pack's ``src_index_T`` a self pad replays exactly its source's fill::

        routes      [ra -- rc | -- -- ]     src_index_T [0 1 2 1 -1]
        filled      [ra f1 rc | f1 f2 ]     (the pad at 3 copies token 1: f1, not a fill of its own)

    ``seed`` differs per pack (e.g. its index): packs with equally many missing rows then
    spread over different experts. Returns a copy with no missing rows.
    """
    routes_TLK = routes_TLK.copy()
    # The fill covers the rows that hold their own token and the constant pads (-1); each copy
    # then takes its source's row (a copy of a copy is refused).
    own_T = _own_rows(src_index_T, routes_TLK.shape[0])
    missing_TL = missing_mask(routes_TLK) & own_T[:, None]
    topk = routes_TLK.shape[2]
    for layer in range(routes_TLK.shape[1]):
        rows_M = np.flatnonzero(missing_TL[:, layer])
        if rows_M.size == 0:
            continue
        # A phase over layer + seed (golden-ratio Kronecker sequence): a layer-only phase sent one
        # missing row per pack to experts 0 and 4 in every pack, unbalancing a micro-batch.
        phase = ((layer + seed) * _LAYER_PHASE_STEP) % 1.0
        experts = balanced_experts(rows_M.size * topk, num_experts, phase)
        routes_TLK[rows_M, layer] = experts.reshape(rows_M.size, topk).astype(routes_TLK.dtype)
    if src_index_T is not None:  # the fill covered own rows and constant pads; copies follow
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
    """Applies ``--replay-missing-route-policy`` at data time: ``native`` leaves rows missing
    (the router decides them in the forward), ``balanced`` fills them
    (:func:`fill_missing_balanced`)."""
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
    """``[T, L, K]`` of vLLM-style routes (T - 1 rows for T tokens, or already T; ValueError
    for any other count): the last row appended as missing."""
    # vLLM and Megatron inference route the tokens fed through the model: all but the last
    # sampled one. A missing row lets the policy decide it (a zero row would go to expert 0).
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
    """Counts ids per EP rank, ranks owning contiguous blocks of ``E / ep_size`` experts."""
    if num_experts % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide num_experts ({num_experts})")
    ranks = np.asarray(experts, dtype=np.int64).reshape(-1) // (num_experts // ep_size)
    return np.bincount(ranks, minlength=ep_size)
