"""Reading rollout route dumps into route buffers (pure numpy, never imports megatron).

Rollout engines return routes in three shapes, all ``[rows, moe_layers, topk]``:

- vLLM ``routed_experts`` (as prime-rl forwards it): ``T - 1`` rows for T tokens, uint8 (uint16
  above 256 experts), either nested lists or ``{"data": <base64 of the raw bytes>, "shape":
  [...], "dtype": "uint8"}``;
- Megatron inference ``moe_topk_indices`` (plus ``prompt_moe_topk_indices`` for the prompt):
  ``T - 1`` rows of int ids, nested lists;
- a plain array ``[T, L, K]`` per document (``.npy``, or one tensor per document in a
  ``.safetensors`` file, read by the small reader below).

:func:`repair_document` turns one of those into a validated ``[T, L, K]`` route buffer: T - 1 is
reconciled (:func:`~megatron_ext.replay.routes.reconcile_t_minus_1`), invalid rows are rejected
(made missing) or raise, and the missing-route policy is applied; it returns counts of what it
fixed. Worked example (E = 8, K = 2, T = 3)::

    rows [[1 2]] [[4 4]]      -> the duplicate row is rejected, the T-1 row appended:
    [[1 2]] [-- --] [-- --]      counts: appended 1, rejected 1 (native policy keeps them missing)

Legend: T tokens of a document, L MoE layers, K top-k.
"""

import base64
import binascii
import dataclasses
import json
import struct
from typing import Any

import numpy as np

from megatron_ext.data.jsonl_documents import refuse_duplicate_keys
from megatron_ext.replay.routes import (
    apply_missing_policy,
    missing_mask,
    missing_value,
    reconcile_t_minus_1,
    route_dtype,
    validate_routes,
)

_DTYPES = {
    "uint8": np.uint8,
    "uint16": np.uint16,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "U8": np.uint8,
    "U16": np.uint16,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


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

    def add(self, other: "RepairCounts") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def decode_routed_experts(
    payload: Any, name: str = "routed_experts", *, may_hold_booleans: bool = True
) -> np.ndarray:
    """Decodes a vLLM / prime-rl ``routed_experts`` value or Megatron's nested lists, exactly.

    Ids are never coerced: fractional, NaN, huge, boolean or string ids, ragged rows and
    payloads whose bytes do not match their shape are refused.

    Args:
        payload: Nested lists ``[rows][L][K]`` of integers, or ``{"data": base64, "shape":
            [rows, L, K], "dtype": "uint8" | "uint16" | ...}``.
        name: Names the payload in errors (``file:line key``).
        may_hold_booleans: False when the caller knows the payload has none (its JSON text holds
            no ``true``/``false``): the scan for booleans among integer ids is skipped.

    Returns:
        ``[rows, L, K]`` array (its own integer dtype).

    Raises:
        ValueError: Any of the above, naming ``name``.
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
    """Refuses a boolean among integer ids: numpy reads ``[true, 3]`` as ``[1, 3]`` (an all-bool
    payload keeps a bool dtype and :func:`check_route_array` refuses it). Only ids read as 0 or
    1 can have been booleans, so only those entries of the payload are looked at."""
    for t, layer, k in np.argwhere((array_TLK == 0) | (array_TLK == 1)).tolist():
        value = payload_TLK[t][layer][k]
        if type(value) is bool:
            raise ValueError(
                f"{name}: token {t}, MoE layer {layer} holds {value!r}, not an expert id"
            )


def check_route_array(array: np.ndarray, name: str) -> None:
    """Refuses an array that is not ``[T, L, K]`` integer ids (bools, floats, strings, objects).

    Raises:
        ValueError: Naming ``name``, the dtype and the first offending value.
    """
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
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise ValueError(
            f"{name}: dtype {dtype_name!r} is not an integer route dtype "
            f"({sorted(k for k in _DTYPES if k.islower())})"
        )
    dtype = np.dtype(_DTYPES[dtype_name])
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
) -> tuple[np.ndarray, RepairCounts]:
    """Makes one document's route buffer: cast, T - 1, invalid rows, missing policy.

    Args:
        rows_TLK: Decoded rows (``num_tokens`` or ``num_tokens - 1`` of them).
        num_tokens: T; None takes the rows as complete.
        num_layers: L.
        topk: K.
        num_experts: E.
        policy: ``native`` or ``balanced``.
        reject_invalid: True: out-of-range / duplicate rows become missing and are counted;
            False: they raise.
        name: For error messages (file and request number).
        seed: The document index: ``balanced`` fills differ per document (see
            :func:`~megatron_ext.replay.routes.fill_missing_balanced`).

    Returns:
        ``(routes_TLK, counts)`` with the dtype of :func:`route_dtype`.

    Raises:
        ValueError: Wrong layer count / top-k, a row count that is neither T nor T - 1, or (with
            ``reject_invalid=False``) an invalid row; messages name the document, token, layer.
    """
    dtype = route_dtype(num_experts, topk)
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
    if rows_TLK.dtype == np.uint64 and rows_TLK.size and int(rows_TLK.max()) > 2**63 - 1:
        raise ValueError(f"{name}: expert id {int(rows_TLK.max())} is beyond int64")
    # Every input value is an id: the input dtype's maximum (255 in a uint8 payload) is a real
    # expert at 256 experts, never a "missing" marker. Only the sidecar's own marker is missing.
    wide = rows_TLK.astype(np.int64)
    bad_TL = ((wide < 0) | (wide >= num_experts)).any(-1)
    sorted_TLK = np.sort(wide, axis=-1)
    bad_TL |= (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(-1)
    counts = RepairCounts(documents=1)
    if bad_TL.any():
        if not reject_invalid:
            token, layer = (int(v) for v in np.argwhere(bad_TL)[0])
            raise ValueError(
                f"{name}: token {token}, MoE layer {layer} has experts {wide[token, layer].tolist()}"
                f" (ids must be distinct and in [0, {num_experts})); --reject-invalid-rows makes"
                " such rows missing instead"
            )
        counts.rejected_rows = int(bad_TL.sum())
    routes_TLK = np.where(bad_TL[..., None], missing_value(dtype), wide)
    routes_TLK = routes_TLK.astype(dtype)
    if num_tokens is not None:
        counts.appended_rows = num_tokens - routes_TLK.shape[0]
        routes_TLK = reconcile_t_minus_1(routes_TLK, num_tokens, name=name)
    counts.tokens = routes_TLK.shape[0]
    before = int(missing_mask(routes_TLK).sum())
    routes_TLK = apply_missing_policy(routes_TLK, policy, num_experts, seed)
    counts.filled_rows = before - int(missing_mask(routes_TLK).sum())
    validate_routes(
        routes_TLK, num_layers=num_layers, num_experts=num_experts, topk=topk, name=name
    )
    return routes_TLK, counts


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Reads every tensor of a ``.safetensors`` file (8-byte header size, JSON header, bytes).

    Raises:
        ValueError: A truncated or corrupt file, naming the file and the tensor's key.
    """
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: not a safetensors file (only {len(blob)} bytes)")
    (header_size,) = struct.unpack("<Q", blob[:8])
    if header_size > len(blob) - 8:
        raise ValueError(f"{path}: safetensors header of {header_size} bytes exceeds the file")
    try:
        header = json.loads(blob[8 : 8 + header_size], object_pairs_hook=refuse_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({err})") from err
    except ValueError as err:  # a tensor key twice: one tensor would be lost
        raise ValueError(f"{path}: safetensors header: {err}") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    data = blob[8 + header_size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{where} lacks dtype/shape/data_offsets")
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{where} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        offsets, shape = info["data_offsets"], info["shape"]
        ints = [*offsets, *shape] if isinstance(offsets, list) and isinstance(shape, list) else []
        if len(offsets) != 2 or not ints or any(type(v) is not int or v < 0 for v in ints):
            raise ValueError(f"{where}: data_offsets/shape must be non-negative integers")
        start, end = offsets
        if not start <= end <= len(data) or end - start != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(
                f"{where}: bytes {start}..{end} do not hold shape {shape} of {dtype} in the "
                f"{len(data)} data bytes (truncated or corrupt file)"
            )
        tensors[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
    return tensors


def safetensors_documents(
    tensors: dict[str, np.ndarray], path: str
) -> list[tuple[str, np.ndarray]]:
    """Orders a safetensors file's per-document tensors by document index.

    Keys must be the document indices ``"0" .. "N-1"``; they are sorted as numbers (a lexical sort
    would put ``"10"`` before ``"2"`` and misalign every document from the tenth on).

    Args:
        tensors: :func:`read_safetensors` of ``path``.
        path: For the error message.

    Returns:
        ``[(key, routes_TLK), ...]`` in document order.

    Raises:
        ValueError: A non-numeric key, or keys that are not exactly ``0 .. N-1``.
    """
    bad = [key for key in tensors if not (key.isascii() and key.isdigit())]
    if bad:
        raise ValueError(
            f"{path}: safetensors keys must be document indices 0..N-1; got non-numeric key(s) "
            f"{sorted(bad)[:5]}"
        )
    ordered = sorted(tensors, key=int)
    if [int(key) for key in ordered] != list(range(len(ordered))):
        gaps = sorted(set(range(len(ordered))) - {int(key) for key in ordered})[:5]
        raise ValueError(
            f"{path}: safetensors keys must be document indices 0..{len(ordered) - 1} exactly "
            f"once (missing {gaps}, or duplicates such as '01' and '1')"
        )
    return [(key, tensors[key]) for key in ordered]


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes integer arrays as a ``.safetensors`` file (for tests and round trips)."""
    codes = {np.dtype(v): k for k, v in _DTYPES.items() if k.isupper()}
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": codes[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
