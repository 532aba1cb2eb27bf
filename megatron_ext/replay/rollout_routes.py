"""What the rollout engines' route readers share (pure numpy, never imports megatron).

The readers (:mod:`~megatron_ext.replay.vllm_routes`, :mod:`~megatron_ext.replay.sglang_routes`)
turn answers into :class:`RolloutDocument` s; :func:`repair_document` makes each a validated
``[T, L, K]`` buffer: rows before the engine's start offset and the last token's row (engines
route ``T - 1`` tokens) missing, invalid rows rejected or refused, the missing-route policy
applied. E = 8, K = 2, T = 4, start offset 1::

    rows [[1 2]] [[4 4]]            -> offset row and T-1 row missing, the duplicate rejected:
    [-- --] [[1 2]] [-- --] [-- --]    counts: offset 1, appended 1, rejected 1 (native policy)

Legend: T tokens of a document, L MoE layers, K top-k.
"""

import base64
import binascii
import dataclasses
from typing import Any

import numpy as np

from megatron_ext.replay.routes import (
    apply_missing_policy,
    missing_mask,
    missing_routes,
    missing_value,
    reconcile_t_minus_1,
    route_dtype,
    validate_routes,
)
from megatron_ext.replay.safetensors_routes import DTYPES
from megatron_ext.replay.safetensors_routes import read_safetensors as read_safetensors
from megatron_ext.replay.safetensors_routes import safetensors_documents as safetensors_documents
from megatron_ext.replay.safetensors_routes import write_safetensors as write_safetensors


@dataclasses.dataclass
class RolloutDocument:
    """One document's routes as an engine returned them, before :func:`repair_document`."""

    name: str
    """Names the record in errors (``file:line``, plus the choice of a response)."""
    rows_TLK: np.ndarray
    """Decoded rows; their layers are the dump's (MoE or decoder layers)."""
    num_tokens: int | None
    """T from the record, or None (then ``--tokens-prefix`` must give it)."""
    start: int = 0
    """First token the rows cover (the engine's start offset); earlier tokens are missing."""
    exact: bool = False
    """The format fixes the rows at ``T - 1 - start`` (a shapeless payload whose row count came
    from its length): ``T - start`` rows are then refused, not taken as complete."""
    token_ids: list | None = None
    """The document's token ids when the record carries them all (prompt and completion):
    checked against the token data, so documents in another order are caught."""
    num_prompt: int | None = None
    """P, the prompt's tokens among ``token_ids`` (the rest is the completion), when the record
    tells them apart (what ``ingest-rollouts`` loss-masks)."""
    moe_rows_first: bool = False
    """A dump of N decoder-layer rows holds the MoE layers' rows first (vLLM 0.21;
    :func:`~megatron_ext.replay.moe_layer_map.select_moe_rows`)."""
    fields: tuple[dict, ...] = ()
    """The JSON objects of the record that describe this document, most specific first (a
    choice, then its response): where ``ingest-rollouts`` looks up per-token keys."""


@dataclasses.dataclass
class RepairCounts:
    """What :func:`repair_document` changed, summed over documents."""

    documents: int = 0
    tokens: int = 0
    appended_rows: int = 0
    """Final rows added for vLLM's T - 1 (then decided by the policy)."""
    rejected_rows: int = 0
    """(token, layer) rows with an out-of-range or duplicate id, made missing."""
    filled_rows: int = 0
    """Missing rows filled by the ``balanced`` policy."""
    offset_rows: int = 0
    """Tokens before the engine's start offset (no route returned), made missing."""
    unrouted_rows: int = 0
    """(token, layer) rows the engine should have routed but did not (before a start offset,
    rejected, missing in the input), whether then left missing or filled; the last token's rows
    (appended, never routed by an engine) are not counted."""
    layer_rows: int = 0
    """(token, layer) rows in all (tokens x L): the denominator of the fractions."""

    def add(self, other: "RepairCounts") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def decode_routed_experts(
    payload: Any, name: str = "routed_experts", *, may_hold_booleans: bool = True
) -> np.ndarray:
    """Decodes a vLLM / prime-rl ``routed_experts`` value or Megatron's nested lists, exactly.

    Ids are never coerced: fractional, NaN, huge, boolean or string ids, ragged rows and
    payloads whose bytes do not match their shape are refused (ValueError naming ``name``).

    Args:
        payload: Nested lists ``[rows][L][K]`` (vLLM 0.21's JSON, Megatron inference's
            ``moe_topk_indices``), or prime-rl's ``{"data": base64 of the raw bytes, "shape":
            [rows, L, K], "dtype": "uint8" | ...}``; decoded in its own integer dtype.
        name: Names the payload in errors (``file:line key``).
        may_hold_booleans: False when the JSON text holds no ``true``/``false``: skips a scan.
    """
    if isinstance(payload, dict):
        array = _decode_base64(payload, name)
    elif isinstance(payload, list):
        try:
            array = np.array(payload)
        except (ValueError, OverflowError) as err:  # ragged nesting
            raise ValueError(f"{name}: rows are ragged or not numbers ({err})") from err
        if array.size == 0:  # no id to check: the shape decides ([] is no rows at all)
            array = np.zeros(array.shape, dtype=np.int64)
        else:
            check_route_array(array, name)
            if array.ndim == 3 and may_hold_booleans:
                _refuse_mixed_booleans(payload, array, name)
    else:
        raise ValueError(f"{name}: expected nested lists or a base64 object, got {payload!r:.40}")
    if array.ndim != 3:
        if array.shape == (0,):  # [] : no rows at all (the shape is then the model's)
            return array.reshape(0, 0, 0)
        raise ValueError(f"{name}: expected [tokens, layers, topk], got {array.shape}")
    return array


def _refuse_mixed_booleans(payload_TLK: list, array_TLK: np.ndarray, name: str) -> None:
    """Refuses a boolean among integer ids: numpy reads ``[true, 3]`` as ``[1, 3]``."""
    # An all-bool payload keeps a bool dtype (check_route_array refuses it). Only ids read as 0
    # or 1 can have been booleans: only those entries of the payload are looked at.
    for t, layer, k in np.argwhere((array_TLK == 0) | (array_TLK == 1)).tolist():
        value = payload_TLK[t][layer][k]
        if type(value) is bool:
            raise ValueError(
                f"{name}: token {t}, MoE layer {layer} holds {value!r}, not an expert id"
            )


def check_route_array(array: np.ndarray, name: str) -> None:
    """Refuses an array that is not ``[T, L, K]`` integer ids (bools, floats, strings, objects),
    naming ``name``, the dtype and the first offending value."""
    if array.dtype.kind not in "iu":
        flat = array.reshape(-1)
        kind = {"b": "boolean", "U": "string", "S": "string"}.get(
            array.dtype.kind, "non-integer (or beyond int64)"
        )
        example = flat[0] if flat.size else None
        if array.dtype.kind == "O":  # ints beyond int64 (or mixed objects): name one of those
            odd = [v for v in flat.tolist() if type(v) is not int or not -(2**63) <= v < 2**64]
            example = odd[0] if odd else example
        if array.dtype.kind == "f":
            with np.errstate(invalid="ignore"):
                odd = np.flatnonzero(~np.isfinite(flat) | (flat != np.round(flat)))
            kind = "non-integer" if odd.size else "float (ids must be integers within int64)"
            example = flat[odd[0]] if odd.size else flat[np.argmax(np.abs(flat))]
        if isinstance(example, np.generic):
            example = example.item()
        raise ValueError(
            f"{name}: expert ids must be integers, got {kind} values such as {example!r} "
            "(never rounded or cast)"
        )
    if array.ndim != 3:
        raise ValueError(f"{name}: expected [tokens, layers, topk], got shape {array.shape}")


def _decode_base64(payload: dict, name: str) -> np.ndarray:
    dtype_name = payload.get("dtype", "uint8")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ValueError(
            f"{name}: dtype {dtype_name!r} is not an integer route dtype "
            f"({sorted(k for k in DTYPES if k.islower())})"
        )
    dtype = np.dtype(DTYPES[dtype_name])
    shape = payload.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or any(type(v) is not int or v < 0 for v in shape)
    ):
        raise ValueError(f"{name}: 'shape' must be 3 non-negative integers, got {shape!r:.60}")
    data = payload.get("data")
    if not isinstance(data, str):
        raise ValueError(f"{name}: 'data' must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{name}: 'data' is not valid base64 ({err})") from err
    if len(raw) != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"{name}: {len(raw)} bytes do not hold shape {tuple(shape)} of {dtype}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def encode_routed_experts(routes_TLK: np.ndarray) -> dict[str, Any]:
    """The base64 form prime-rl sends (inverse of :func:`decode_routed_experts`)."""
    return {
        "data": base64.b64encode(np.ascontiguousarray(routes_TLK).tobytes()).decode("ascii"),
        "shape": list(routes_TLK.shape),
        "dtype": str(routes_TLK.dtype),
    }


def repair_document(
    rows_TLK: np.ndarray,
    num_tokens: int | None,
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    policy: str,
    reject_invalid: bool,
    name: str,
    seed: int = 0,
    start: int = 0,
    exact: bool = False,
) -> tuple[np.ndarray, RepairCounts]:
    """Makes one document's route buffer: cast, offset, T - 1, invalid rows, missing policy.

    Args:
        rows_TLK: Decoded rows (``num_tokens - start`` or ``num_tokens - 1 - start`` of them).
        num_tokens: T; None takes the rows (after ``start`` missing ones) as complete.
        reject_invalid: Out-of-range / duplicate rows become missing (counted), else raise.
        seed: The document index: ``balanced`` fills differ per document.
        start, exact: :attr:`RolloutDocument.start` and :attr:`RolloutDocument.exact`.

    Returns:
        ``(routes_TLK, counts)`` with the dtype of :func:`route_dtype`. ValueError (naming the
        document, token and layer) for wrong L or K, another row count, or an invalid row.
    """
    dtype = route_dtype(num_experts, topk)
    rows_TLK = _shaped_rows(rows_TLK, num_tokens, num_layers, topk, name, start, exact)
    # Every input value is an id: the input dtype's maximum (255 in a uint8 payload) is a real
    # expert at 256 experts, never a "missing" marker. Only the sidecar's own marker is missing.
    wide = rows_TLK.astype(np.int64)
    bad_TL = _invalid_rows(wide, num_experts, reject_invalid, name)
    counts = RepairCounts(documents=1, rejected_rows=int(bad_TL.sum()))
    routes_TLK = np.where(bad_TL[..., None], missing_value(dtype), wide)
    routes_TLK = _place_rows(routes_TLK.astype(dtype), num_tokens, start, counts, name)
    counts.tokens = routes_TLK.shape[0]
    counts.layer_rows = routes_TLK.shape[0] * num_layers
    before = int(missing_mask(routes_TLK).sum())
    counts.unrouted_rows = before - counts.appended_rows * num_layers  # appended: all missing
    routes_TLK = apply_missing_policy(routes_TLK, policy, num_experts, seed)
    counts.filled_rows = before - int(missing_mask(routes_TLK).sum())
    validate_routes(
        routes_TLK, num_layers=num_layers, num_experts=num_experts, topk=topk, name=name
    )
    return routes_TLK, counts


def _place_rows(
    routes_TLK: np.ndarray, num_tokens: int | None, start: int, counts: RepairCounts, name: str
) -> np.ndarray:
    """The rows at their tokens: ``start`` missing rows before them, the T - 1 row after."""
    if start:  # vLLM routed_experts_prompt_start, SGLang routed_experts_start_len
        counts.offset_rows = start
        num_layers, topk = routes_TLK.shape[1:]
        routes_TLK = np.concatenate(
            [missing_routes(start, num_layers, topk, routes_TLK.dtype), routes_TLK]
        )
    if num_tokens is not None:
        counts.appended_rows = num_tokens - routes_TLK.shape[0]
        where = f"{name} (rows from token {start} on)" if start else name
        routes_TLK = reconcile_t_minus_1(routes_TLK, num_tokens, name=where)
    return routes_TLK


def _shaped_rows(
    rows_TLK: np.ndarray,
    num_tokens: int | None,
    num_layers: int,
    topk: int,
    name: str,
    start: int,
    exact: bool,
) -> np.ndarray:
    """The decoded rows as ``[T', L, K]``, their shape and count checked."""
    if rows_TLK.shape in ((0,), (0, 0, 0)):  # no rows and no shape (an empty list)
        rows_TLK = np.zeros((0, num_layers, topk), dtype=np.int64)
    if rows_TLK.ndim != 3:
        raise ValueError(f"{name}: expected routes [tokens, layers, topk], got {rows_TLK.shape}")
    check_route_array(rows_TLK, name)
    if rows_TLK.shape[1:] != (num_layers, topk):
        raise ValueError(
            f"{name}: routes have {rows_TLK.shape[1]} MoE layers x top-{rows_TLK.shape[2]}, "
            f"expected {num_layers} MoE layers x top-{topk} (--num-layers, --topk)"
        )
    if num_tokens is not None and exact and start + rows_TLK.shape[0] != max(num_tokens - 1, 0):
        raise ValueError(
            f"{name}: {rows_TLK.shape[0]} rows of {num_layers} layers x top-{topk} from token "
            f"{start} on, but T = {num_tokens} tokens need T - 1{f' - {start}' if start else ''} = "
            f"{max(num_tokens - 1 - start, 0)} (the payload's element type is fixed by the "
            "format: a payload of another element type or layer count is refused, not guessed)"
        )
    if rows_TLK.dtype == np.uint64 and rows_TLK.size and int(rows_TLK.max()) > 2**63 - 1:
        raise ValueError(f"{name}: expert id {int(rows_TLK.max())} is beyond int64")
    return rows_TLK


def _invalid_rows(wide_TLK: np.ndarray, num_experts: int, reject: bool, name: str) -> np.ndarray:
    """``[T', L]`` True where a row has an id out of range or twice; raises on the first one
    unless ``reject`` (then they become missing)."""
    bad_TL = ((wide_TLK < 0) | (wide_TLK >= num_experts)).any(-1)
    sorted_TLK = np.sort(wide_TLK, axis=-1)
    bad_TL |= (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(-1)
    if bad_TL.any() and not reject:
        token, layer = (int(v) for v in np.argwhere(bad_TL)[0])
        raise ValueError(
            f"{name}: token {token}, MoE layer {layer} has experts "
            f"{wide_TLK[token, layer].tolist()} (ids must be distinct and in [0, {num_experts})); "
            "--reject-invalid-rows makes such rows missing instead"
        )
    return bad_TL
