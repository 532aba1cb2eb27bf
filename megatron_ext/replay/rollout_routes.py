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
import dataclasses
import json
import struct
from typing import Any

import numpy as np

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


def decode_routed_experts(payload: Any) -> np.ndarray:
    """Decodes a vLLM / prime-rl ``routed_experts`` value or Megatron's nested lists.

    Args:
        payload: Nested lists ``[rows][L][K]``, or ``{"data": base64, "shape": [rows, L, K],
            "dtype": "uint8" | "uint16"}``.

    Returns:
        ``[rows, L, K]`` array (its own integer dtype).

    Raises:
        ValueError: Bad base64 payload size or rank.
    """
    if isinstance(payload, dict):
        dtype = np.dtype(_DTYPES[payload.get("dtype", "uint8")])
        shape = tuple(int(v) for v in payload["shape"])
        raw = base64.b64decode(payload["data"])
        if len(raw) != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(
                f"routed_experts: {len(raw)} bytes do not hold shape {shape} of {dtype}"
            )
        array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    else:
        array = np.asarray(payload, dtype=np.int64)
    if array.ndim != 3:
        if array.size == 0:
            return array.reshape(0, 0, 0)
        raise ValueError(f"routed_experts: expected [tokens, layers, topk], got {array.shape}")
    return array


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
    if rows_TLK.size == 0:
        rows_TLK = np.zeros((0, num_layers, topk), dtype=np.int64)
    if rows_TLK.shape[1:] != (num_layers, topk):
        raise ValueError(
            f"{name}: routes are [*, {rows_TLK.shape[1]}, {rows_TLK.shape[2]}], expected "
            f"{num_layers} MoE layers x top-{topk}"
        )
    wide = rows_TLK.astype(np.int64)
    was_marker = (
        (wide == missing_value(np.dtype(rows_TLK.dtype))).all(-1)
        if (rows_TLK.dtype in (np.uint8, np.uint16))
        else np.zeros(wide.shape[:2], dtype=bool)
    )
    bad_TL = ((wide < 0) | (wide >= num_experts)).any(-1)
    sorted_TLK = np.sort(wide, axis=-1)
    bad_TL |= (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(-1)
    bad_TL &= ~was_marker
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
    routes_TLK = np.where((bad_TL | was_marker)[..., None], missing_value(dtype), wide)
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
    """Reads every tensor of a ``.safetensors`` file (8-byte header size, JSON header, bytes)."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        tensors[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"])
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
