"""Route documents in a ``.safetensors`` file: one tensor ``[T, L, K]`` per document, keyed
``"0" .. "N-1"`` (pure numpy, never imports megatron). Tensors are memory-mapped, not read: a file
larger than memory converts one document at a time::

    write_safetensors("r.safetensors", {"0": routes_a, "1": routes_b})
    [key for key, _ in safetensors_documents(read_safetensors("r.safetensors"), "r.safetensors")]
    # -> ["0", "1"]

Legend: T tokens of a document, L MoE layers, K top-k.
"""

import json
import os
import struct

import numpy as np

from megatron_ext.common.jsonl_lines import refuse_duplicate_keys

#: Integer dtypes a route payload may have, by the names JSON payloads and safetensors use.
DTYPES = {
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


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Maps every tensor of a ``.safetensors`` file; ValueError naming the file and the tensor's
    key for a truncated or corrupt one."""
    # huggingface/safetensors' format: an 8-byte little-endian header size, a JSON header
    # {key: {"dtype", "shape", "data_offsets"}}, then the tensors' bytes.
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {len(head)} bytes)")
        (header_size,) = struct.unpack("<Q", head)
        if header_size > size - 8:
            raise ValueError(f"{path}: safetensors header of {header_size} bytes exceeds the file")
        header_text = f.read(header_size)
    try:
        header = json.loads(header_text, object_pairs_hook=refuse_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({err})") from err
    except ValueError as err:  # a tensor key twice: one tensor would be lost
        raise ValueError(f"{path}: safetensors header: {err}") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - header_size
    data = (
        np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_size)
        if data_bytes
        else np.zeros(0, dtype=np.uint8)
    )
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise ValueError(f"{where} lacks dtype/shape/data_offsets")
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{where} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(DTYPES[info["dtype"]])
        offsets, shape = info["data_offsets"], info["shape"]
        ints = [*offsets, *shape] if isinstance(offsets, list) and isinstance(shape, list) else []
        if len(offsets) != 2 or not ints or any(type(v) is not int or v < 0 for v in ints):
            raise ValueError(f"{where}: data_offsets/shape must be non-negative integers")
        start, end = offsets
        if not start <= end <= data_bytes or end - start != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(
                f"{where}: bytes {start}..{end} do not hold shape {shape} of {dtype} in the "
                f"{data_bytes} data bytes (truncated or corrupt file)"
            )
        tensors[name] = data[start:end].view(dtype).reshape(shape)  # mapped, not read
    return tensors


def safetensors_documents(
    tensors: dict[str, np.ndarray], path: str
) -> list[tuple[str, np.ndarray]]:
    """``[(key, routes_TLK), ...]`` of :func:`read_safetensors`' tensors in document order; keys
    must be exactly ``"0" .. "N-1"`` (ValueError naming ``path``)."""
    bad = [key for key in tensors if not (key.isascii() and key.isdigit())]
    if bad:
        raise ValueError(
            f"{path}: safetensors keys must be document indices 0..N-1; got non-numeric key(s) "
            f"{sorted(bad)[:5]}"
        )
    ordered = sorted(tensors, key=int)  # lexically "10" < "2": every document from the tenth off
    if [int(key) for key in ordered] != list(range(len(ordered))):
        gaps = sorted(set(range(len(ordered))) - {int(key) for key in ordered})[:5]
        raise ValueError(
            f"{path}: safetensors keys must be document indices 0..{len(ordered) - 1} exactly "
            f"once (missing {gaps}, or duplicates such as '01' and '1')"
        )
    return [(key, tensors[key]) for key in ordered]


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes integer arrays as a ``.safetensors`` file (for tests and round trips)."""
    codes = {np.dtype(v): k for k, v in DTYPES.items() if k.isupper()}
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
