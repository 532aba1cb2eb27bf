"""The route sidecar on disk: its header and whole-file validation (pure numpy, never imports
megatron).

A route sidecar ``P.bin/.idx`` stores ``routes_TLK`` flattened per document, so its ``.idx`` alone
cannot tell L = 2, K = 2 from L = 4, K = 1 (both 4 ids per token); ``P.routes.json`` beside it says
what the ids mean and which token data they belong to (docs/replay.md, "Format")::

    {"format": "megatron_ext.routes", "version": 1, "num_layers": 2, "topk": 2,
     "num_experts": 8, "dtype": "uint8", "num_documents": 3, "num_tokens": 15,
     "tokens_digest": "9b1c..."}

Legend: T tokens (rows), L MoE layers, K top-k, E experts.
"""

import json
from collections.abc import Sequence

import numpy as np

#: Extension of the header file beside ``P.bin`` / ``P.idx``.
HEADER_EXTENSION = ".routes.json"
FORMAT = "megatron_ext.routes"
VERSION = 1


def tokens_digest(tokens_prefix: str) -> str:
    """The content digest of the token data ``tokens_prefix.idx/.bin`` the routes belong to."""
    from megatron_ext.common.safe_files import content_digest

    return content_digest([tokens_prefix + ".idx", tokens_prefix + ".bin"])


def header_bytes(
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    dtype: np.dtype,
    lengths_D: np.ndarray,
    tokens: str | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> bytes:
    """The header of a route sidecar whose document d holds ``lengths_D[d]`` tokens.

    ``tokens``: :func:`tokens_digest` of the token data the routes belong to (the dataset then
    refuses them beside other tokens, even of the same lengths); None when the writer does not
    know it. ``moe_layer_ids``: the 0-based decoder layers of the L rows, in the *source*
    model's numbering.
    """
    header = {
        "format": FORMAT,
        "version": VERSION,
        "num_layers": int(num_layers),
        "topk": int(topk),
        "num_experts": int(num_experts),
        "dtype": np.dtype(dtype).name,
        "num_documents": int(np.asarray(lengths_D).size),
        "num_tokens": int(np.sum(lengths_D, dtype=np.int64)),  # no int64 copy of the lengths
    }
    if tokens is not None:
        header["tokens_digest"] = tokens
    if moe_layer_ids is not None:
        assert len(moe_layer_ids) == num_layers, (moe_layer_ids, num_layers)
        header["moe_layer_ids"] = [int(i) for i in moe_layer_ids]
    return (json.dumps(header, indent=1) + "\n").encode("utf-8")


def read_header(path: str) -> dict:
    """Reads a header file; ValueError naming it for one not JSON, of another format, or with a
    missing or malformed field."""
    try:
        with open(path, encoding="utf-8") as f:
            header = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"route header {path} is not valid JSON ({err})") from err
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"route header {path} is not a {FORMAT} header")
    if header.get("version") != VERSION:
        raise ValueError(f"route header {path} has version {header.get('version')}, not {VERSION}")
    for key in ("num_layers", "topk", "num_experts", "num_documents", "num_tokens"):
        if type(header.get(key)) is not int or header[key] < 0:
            raise ValueError(f"route header {path}: {key!r} must be a non-negative integer")
    if "tokens_digest" in header and not isinstance(header["tokens_digest"], str):
        raise ValueError(f"route header {path}: 'tokens_digest' must be a string")
    if "moe_layer_ids" in header:
        ids = header["moe_layer_ids"]
        if (
            not isinstance(ids, list)
            or any(type(i) is not int or i < 0 for i in ids)
            or ids != sorted(set(ids))
            or len(ids) != header["num_layers"]
        ):
            raise ValueError(
                f"route header {path}: 'moe_layer_ids' must be num_layers distinct increasing "
                "non-negative integers"
            )
    return header


def check_layer_ids(header: dict, path: str, moe_layer_ids: Sequence[int]) -> None:
    """Refuses a route file whose header's ``moe_layer_ids`` are not as many as the model's MoE
    layers (0-based), naming both lists."""
    # Row i replays on the model's i-th MoE layer, whatever the numbers: a HybridModel counts
    # attention and MoE as layers of their own (*E*E: MoE layers 1 and 3 for a Hugging Face
    # config's decoder layers 0 and 1). Only another count is a true mismatch.
    written = header.get("moe_layer_ids")
    if written is not None and len(written) != len(moe_layer_ids):
        raise ValueError(
            f"route file {path} holds the routes of {len(written)} MoE layers (the source "
            f"model's decoder layers {_ranges(written)}, 0-based), but the model has "
            f"{len(moe_layer_ids)} MoE layers ({_ranges(moe_layer_ids)}: --moe-layer-freq, or the "
            "E positions of --hybrid-layer-pattern); rows map onto the model's MoE layers in "
            "order, so their counts must agree: convert the routes with the model's layer map "
            "(--moe-layer-ids / --model-config) or fix the model's MoE layers"
        )


def _ranges(ids: Sequence[int]) -> str:
    """``[3, 4, 5, 7]`` -> ``"3-5,7"`` (messages stay one line for 60-layer models)."""
    parts: list[str] = []
    for i in ids:
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"


def check_written_for(
    header: dict, path: str, *, num_layers: int, topk: int, num_experts: int
) -> None:
    """Refuses a route file whose header says it was written for another model (L, K, E).

    Used at argument time (header only) and at dataset build (:func:`check_header`).
    """
    written = (header["num_layers"], header["topk"], header["num_experts"])
    if written != (num_layers, topk, num_experts):
        raise ValueError(
            f"route file {path} was written for {written[0]} MoE layers x top-{written[1]} over "
            f"{written[2]} experts; the model has {num_layers} MoE layers x top-{topk} over "
            f"{num_experts} experts (--num-layers/--moe-layer-freq or --hybrid-layer-pattern, "
            "--moe-router-topk, --num-experts)"
        )


def check_header(
    header: dict,
    path: str,
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    dtype: np.dtype,
    num_documents: int,
    num_values: int,
) -> None:
    """Refuses a route file written for another model (L without MTP, K, E) or other data (the
    ``dtype``, ``num_documents`` and ``num_values`` its ``.idx`` stores).

    Alignment with the token documents is checked per document by the dataset.
    """
    check_written_for(header, path, num_layers=num_layers, topk=topk, num_experts=num_experts)
    if header.get("dtype") != np.dtype(dtype).name:
        raise ValueError(
            f"route file {path} says {header.get('dtype')} but its .idx stores "
            f"{np.dtype(dtype).name}: the header belongs to another file"
        )
    written_values = header["num_tokens"] * num_layers * topk
    if (header["num_documents"], written_values) != (num_documents, num_values):
        raise ValueError(
            f"route file {path} describes {header['num_documents']} documents / "
            f"{header['num_tokens']} tokens, but its .idx indexes {num_documents} documents / "
            f"{num_values} ids: the header belongs to another file"
        )


#: Most values one block of :func:`first_invalid_row` compares at a time (its temporaries).
BLOCK_VALUES = 1 << 16


def first_invalid_row(routes_TLK: np.ndarray, num_experts: int) -> tuple[int, int, str] | None:
    """``(token, layer, what)`` of the first (token-major) row that is not a valid route, or None.

    A row is valid when it is missing or holds K distinct ids below ``num_experts``: the rules
    of :func:`~megatron_ext.replay.routes.validate_routes`, vectorized.
    """
    # Blocks of at most an eighth of the input (and BLOCK_VALUES values), slot by slot with
    # [rows, L] temporaries: never more than the input's size again (a [T, L, K] mask per rule
    # and a sorted copy used to take 4.5-11 times the input).
    num_rows, num_layers, topk = routes_TLK.shape
    width = max(num_layers * topk, 1)
    block = max(1, min(-(-num_rows // 8), BLOCK_VALUES // width))
    for start in range(0, num_rows, block):
        bad = _first_invalid_in_block(routes_TLK[start : start + block], num_experts)
        if bad is not None:
            token, layer, what = bad
            return start + token, layer, what
    return None


def _first_invalid_in_block(
    routes_TLK: np.ndarray, num_experts: int
) -> tuple[int, int, str] | None:
    """:func:`first_invalid_row` of one block, built from per-slot ``[T, L]`` comparisons."""
    marker = int(np.iinfo(routes_TLK.dtype).max)
    topk = routes_TLK.shape[2]
    slots = [routes_TLK[..., k] for k in range(topk)]  # strided views, no copies
    missing_TL = slots[0] == marker
    any_marker_TL = missing_TL.copy()
    too_big_TL = slots[0] >= num_experts
    duplicate_TL = np.zeros_like(missing_TL)
    for k in range(1, topk):
        is_marker = slots[k] == marker
        np.logical_and(missing_TL, is_marker, out=missing_TL)
        np.logical_or(any_marker_TL, is_marker, out=any_marker_TL)
        np.logical_or(too_big_TL, slots[k] >= num_experts, out=too_big_TL)
        for j in range(k):
            np.logical_or(duplicate_TL, slots[j] == slots[k], out=duplicate_TL)
    if num_experts > marker:  # a 256-expert uint8 file uses 255 as an id
        any_marker_TL[:] = False
    else:  # the marker itself is >= num_experts: only ids other than it are out of range
        too_big_TL = _without_marker(too_big_TL, slots, marker, num_experts)
    bad = {
        "mixes the missing-row marker with real ids": any_marker_TL,
        f"has an expert id >= num_experts ({num_experts})": too_big_TL,
        "has duplicate expert ids in its top-k": duplicate_TL,
    }
    first = None
    for what, bad_TL in bad.items():
        np.logical_and(bad_TL, ~missing_TL, out=bad_TL)
        flat = np.flatnonzero(bad_TL)
        if flat.size and (first is None or flat[0] < first[0]):
            first = (int(flat[0]), what)
    if first is None:
        return None
    token, layer = divmod(first[0], routes_TLK.shape[1])
    return token, layer, first[1]


def _without_marker(
    too_big_TL: np.ndarray, slots: list[np.ndarray], marker: int, num_experts: int
) -> np.ndarray:
    """Rows holding an id in ``[num_experts, marker)`` (the marker is not an out-of-range id)."""
    if not too_big_TL.any():
        return too_big_TL
    too_big_TL[:] = False
    for slot in slots:
        np.logical_or(too_big_TL, (slot >= num_experts) & (slot != marker), out=too_big_TL)
    return too_big_TL
