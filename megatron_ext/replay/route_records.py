"""Rollout dump files -> route documents, one record at a time (pure numpy, never imports megatron).

What ``tools/convert_routes.py`` reads, per ``--format`` (``vllm``, ``megatron``, ``sglang``,
``npy``, ``safetensors``; docs/replay.md, "Converting rollouts"). Memory holds one record,
whatever the file's size::

    for doc in read_documents(["rollouts.jsonl"], "vllm", wire_layers=61, topk=8):
        doc.name, doc.rows_TLK.shape, doc.num_tokens   # "rollouts.jsonl:1 choice 0", ...

Legend: T tokens of a document, L layers per row of the dump, K top-k.
"""

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from megatron_ext.common.jsonl_lines import decode_line, refuse_duplicate_keys
from megatron_ext.replay.rollout_routes import (
    RolloutDocument,
    check_route_array,
    decode_routed_experts,
    read_safetensors,
    safetensors_documents,
)
from megatron_ext.replay.sglang_routes import decode_sglang_record
from megatron_ext.replay.vllm_routes import (
    PROMPT_START_KEY,
    decode_vllm_routes,
    moe_rows_first,
    vllm_response_documents,
)

#: Formats whose records hold one row fewer than their tokens (T is needed to know it).
T_MINUS_ONE_FORMATS = ("vllm", "megatron", "sglang")
FORMATS = ("vllm", "megatron", "sglang", "npy", "safetensors")
_MEGATRON_KEYS = ("prompt_moe_topk_indices", "moe_topk_indices")


def _num_tokens(record: dict, name: str) -> int | None:
    """T from ``num_tokens`` and/or ``token_ids``; both given must agree (neither wins)."""
    count = None
    if "num_tokens" in record:
        count = record["num_tokens"]
        if type(count) is not int or count < 0:
            raise ValueError(f"{name}: num_tokens must be a non-negative integer, got {count!r}")
    if "token_ids" in record:
        ids = record["token_ids"]
        if not isinstance(ids, list):
            raise ValueError(f"{name}: token_ids must be a list, got {type(ids).__name__}")
        if count is not None and count != len(ids):
            raise ValueError(f"{name}: num_tokens {count} disagrees with the {len(ids)} token_ids")
        count = len(ids)
    return count


#: Record keys of a sequence's prompt and completion ids (prime-rl's ``prompt_ids`` /
#: ``completion_ids``, or vLLM's names), what ``ingest-rollouts`` writes and loss-masks.
SPLIT_ID_KEYS = (("prompt_ids", "completion_ids"), ("prompt_token_ids", "completion_token_ids"))


def _split_ids(record: dict, name: str, count: int | None) -> tuple[list | None, int | None]:
    """``(prompt + completion ids, P)`` from a record's split id keys, else ``(token_ids, None)``;
    a ``token_ids`` or ``num_tokens`` beside them must agree."""
    for prompt_key, completion_key in SPLIT_ID_KEYS:
        if prompt_key in record or completion_key in record:
            prompt, completion = record.get(prompt_key), record.get(completion_key)
            if not isinstance(prompt, list) or not isinstance(completion, list):
                raise ValueError(
                    f"{name}: {prompt_key} and {completion_key} must both be lists of token ids"
                )
            ids = prompt + completion
            if "token_ids" in record and record["token_ids"] != ids:
                raise ValueError(f"{name}: token_ids is not {prompt_key} + {completion_key}")
            if count is not None and count != len(ids):
                raise ValueError(
                    f"{name}: num_tokens {count} disagrees with the {len(ids)} ids of "
                    f"{prompt_key} + {completion_key}"
                )
            return ids, len(prompt)
    return record.get("token_ids"), None


def _load_npy(path: str) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r")
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path}: not a readable .npy of integer ids ({err})") from err
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{path}: holds several arrays (.npz), expected one [T, L, K] array")
    check_route_array(array, path)
    return array


def read_documents(
    paths: list[str],
    fmt: str,
    *,
    wire_layers: int = 0,
    topk: int = 0,
    start: int = 0,
    vllm_moe_rows: str = "auto",
) -> Iterator[RolloutDocument]:
    """Yields the documents of ``paths`` in order.

    Args:
        fmt: One of :data:`FORMATS`.
        wire_layers, topk: The rows' layers and K where the payload has no shape (SGLang's
            base64): the model's decoder layers with a layer map, else its MoE layers.
        start: The requests' start offset; a record's own key overrides it.
    """
    for path in paths:
        if fmt == "npy":
            yield RolloutDocument(path, _load_npy(path), None)
        elif fmt == "safetensors":
            for key, array in safetensors_documents(read_safetensors(path), path):
                yield RolloutDocument(f"{path}[{key}]", array, None)
        else:
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    name = f"{path}:{line_no}"
                    line = decode_line(raw, name)
                    if line is None:
                        continue
                    yield from documents_of_line(
                        line, fmt, name, wire_layers, topk, start, vllm_moe_rows
                    )


def documents_of_line(
    line: str,
    fmt: str,
    name: str,
    wire_layers: int,
    topk: int,
    start: int,
    vllm_moe_rows: str = "auto",
) -> list[RolloutDocument]:
    """One JSONL line -> its documents (a JSON list: each element's, named ``file:line[i]``)."""
    try:
        record = json.loads(line, object_pairs_hook=refuse_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc})") from exc
    except ValueError as exc:  # the duplicate-key hook
        raise ValueError(f"{name}: {exc}") from exc
    # A boolean can only be there if the JSON text spells one: else skip the scan for them.
    booleans = "true" in line or "false" in line
    shape = (wire_layers, topk, start, booleans, vllm_moe_rows)
    if isinstance(record, list):  # a batched answer: one record per element, in order
        if not record:
            raise ValueError(f"{name}: an empty JSON list holds no record")
        return [
            doc
            for i, item in enumerate(record)
            for doc in _documents(item, fmt, f"{name}[{i}]", *shape)
        ]
    return _documents(record, fmt, name, *shape)


def _documents(
    record: Any,
    fmt: str,
    name: str,
    wire_layers: int,
    topk: int,
    start: int,
    booleans: bool,
    vllm_moe_rows: str,
) -> list[RolloutDocument]:
    if fmt == "sglang":
        return decode_sglang_record(
            record, num_layers=wire_layers, topk=topk, name=name, start_len=start
        )
    if not isinstance(record, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(record).__name__}")
    # vllm: a whole response, or a record {"routed_experts": .npy base64 | nested lists |
    # prime-rl's {"data", "shape", "dtype"}, "num_tokens": T or "token_ids": [...]}; megatron:
    # {"prompt_moe_topk_indices", "moe_topk_indices", "num_tokens"}.
    if fmt == "vllm" and "choices" in record:
        return vllm_response_documents(
            record, name, prompt_start=start, vllm_moe_rows=vllm_moe_rows
        )
    keys = ("routed_experts",) if fmt == "vllm" else _MEGATRON_KEYS
    if not any(key in record for key in keys):
        what = " (or a whole response with 'choices')" if fmt == "vllm" else ""
        raise ValueError(
            f"{name}: a --format {fmt} record needs a {' or '.join(map(repr, keys))} key{what}"
        )
    num_tokens = _num_tokens(record, name)
    ids, num_prompt = _split_ids(record, name, num_tokens)
    if num_tokens is None and ids is not None:
        num_tokens = len(ids)
    split = {"token_ids": ids, "num_prompt": num_prompt, "fields": (record,)}
    if fmt == "vllm":
        offset = record.get(PROMPT_START_KEY, start)
        if type(offset) is not int or offset < 0:
            raise ValueError(f"{name}: {PROMPT_START_KEY} must be a non-negative integer")
        rows = decode_vllm_routes(record["routed_experts"], f"{name} routed_experts", booleans)
        first = moe_rows_first(record, vllm_moe_rows)
        return [
            RolloutDocument(name, rows, num_tokens, start=offset, moe_rows_first=first, **split)
        ]
    # A key that is present is decoded whatever it holds (0 or "" is refused there, not skipped;
    # null counts as absent); an empty part (no rows, e.g. an empty prompt) adds nothing.
    parts = [
        decode_routed_experts(record[key], f"{name} {key}", may_hold_booleans=booleans)
        for key in keys
        if record.get(key, None) is not None
    ]
    parts = [p for p in parts if p.shape != (0, 0, 0)]
    shapes = {p.shape[1:] for p in parts}
    if len(shapes) > 1:
        raise ValueError(f"{name}: {' and '.join(keys)} have different [layers, topk] {shapes}")
    rows = np.concatenate(parts) if parts else np.zeros((0, 0, 0), dtype=np.int64)
    return [RolloutDocument(name, rows, num_tokens, **split)]
