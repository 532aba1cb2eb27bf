"""SGLang ``return_routed_experts`` records -> route rows (pure numpy, never imports megatron).

SGLang (``--enable-return-routed-experts`` on the server, ``"return_routed_experts": true`` on a
``/generate`` request; what slime and miles replay from) returns the top-k of every token it fed
forward as ``meta_info.routed_experts``: base64 of the raw bytes of an int32 array ``[T - 1, L, K]``
(C order), with ``T = meta_info.prompt_tokens + meta_info.completion_tokens``; the last generated
token was never fed forward, so it has no row. The base64 carries no shape: ``L`` and ``K`` come
from the caller (``--num-layers``, ``--topk``) and ``T`` from the record. Some dumps keep the value
as nested lists ``[T - 1][L][K]`` instead. A record is a response as ``/generate`` returns it, or a
training sample that carries its ``tokens`` (or ``token_ids``) beside ``meta_info``; in a multi-turn
rollout each turn's value covers the whole sequence so far, so the last turn's record is the one to
keep. Worked example (L = 1, K = 2)::

    {"meta_info": {"prompt_tokens": 2, "completion_tokens": 1,
                   "routed_experts": base64(int32 [[[1, 4]], [[0, 2]]])}}
    -> rows [[1 4]] [[0 2]] and T = 3 (repair_document appends the missing T-th row)

Legend: T tokens of a document, L MoE layers, K top-k.
"""

import base64
import binascii
from typing import Any

import numpy as np

from megatron_ext.replay.rollout_routes import decode_routed_experts

#: SGLang's dtype for routed expert ids (its capturer's int32 buffers), little-endian on the wire.
SGLANG_DTYPE = np.dtype("<i4")


def _count(meta: dict, key: str, name: str) -> int:
    value = meta[key]
    if type(value) is not int or value < 0:
        raise ValueError(
            f"{name}: meta_info.{key} must be a non-negative integer, got {value!r:.40}"
        )
    return value


def sglang_num_tokens(record: dict, name: str) -> int | None:
    """T of one record: ``prompt_tokens + completion_tokens`` and/or the sample's token list.

    Both given must agree (neither wins); neither given is None.

    Raises:
        ValueError: A count that is not a non-negative integer, only one of the two counts,
            ``tokens`` and ``token_ids`` of different lengths, or counts that disagree.
    """
    meta = record["meta_info"]
    counted = None
    present = [key for key in ("prompt_tokens", "completion_tokens") if key in meta]
    if len(present) == 1:
        raise ValueError(
            f"{name}: meta_info has {present[0]} but not "
            f"{({'prompt_tokens', 'completion_tokens'} - set(present)).pop()} (T is their sum)"
        )
    if present:
        counted = _count(meta, "prompt_tokens", name) + _count(meta, "completion_tokens", name)
    lengths = {}
    for key in ("tokens", "token_ids"):
        if key in record:
            if not isinstance(record[key], list):
                raise ValueError(f"{name}: {key} must be a list, got {type(record[key]).__name__}")
            lengths[key] = len(record[key])
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{name}: tokens and token_ids have different lengths {lengths}")
    listed = next(iter(lengths.values()), None)
    if counted is not None and listed is not None and counted != listed:
        key = next(iter(lengths))
        raise ValueError(
            f"{name}: meta_info prompt_tokens + completion_tokens = {counted} disagrees with the "
            f"{listed} {key}"
        )
    return counted if counted is not None else listed


def decode_sglang_base64(
    data: str, num_tokens: int | None, *, num_layers: int, topk: int, name: str
) -> np.ndarray:
    """SGLang's base64 int32 payload -> ``[rows, L, K]`` int32 rows, exactly.

    Rows are ``T - 1`` (what SGLang sends) or ``T``; with ``num_tokens`` None, the byte count
    alone decides (it must be whole rows of ``L * K`` ids).

    Raises:
        ValueError: Invalid base64, a byte count that is not whole int32 ids, or an id count
            that is not ``T - 1`` (or ``T``) rows of ``[L, K]``; the message says what it holds.
    """
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{name}: not valid base64 ({err})") from err
    if len(raw) % SGLANG_DTYPE.itemsize:
        raise ValueError(f"{name}: {len(raw)} bytes are not whole int32 expert ids")
    ids = np.frombuffer(raw, dtype=SGLANG_DTYPE)
    per_row = num_layers * topk
    rows, extra = divmod(ids.size, per_row)
    if extra or (num_tokens is not None and rows not in (max(num_tokens - 1, 0), num_tokens)):
        want = "whole rows" if num_tokens is None else f"T - 1 = {max(num_tokens - 1, 0)} rows"
        hint = ""
        if num_tokens and num_tokens > 1 and ids.size % ((num_tokens - 1) * topk) == 0:
            layers = ids.size // ((num_tokens - 1) * topk)
            hint = (
                f"; that is {layers} layers x top-{topk} per row (SGLang records every hidden "
                "layer it routes: --num-layers must be the model's MoE layer count)"
            )
        raise ValueError(
            f"{name}: {ids.size} int32 ids are not {want} of {num_layers} MoE layers x "
            f"top-{topk} (--num-layers, --topk){hint}"
        )
    return ids.reshape(rows, num_layers, topk)


def decode_sglang_record(
    record: Any, *, num_layers: int, topk: int, name: str
) -> tuple[np.ndarray, int | None]:
    """One SGLang response or sample -> ``(rows_TLK, T or None)`` for ``repair_document``.

    Args:
        record: A parsed JSONL line: ``{"meta_info": {"routed_experts": ..., "prompt_tokens":
            P, "completion_tokens": C, ...}, ...}``, optionally with ``tokens``/``token_ids``.
        num_layers: L (the base64 form has no shape).
        topk: K.
        name: Names the record in errors (``file:line``).

    Raises:
        ValueError: A record without ``meta_info.routed_experts`` (or with it null), or any
            error of :func:`sglang_num_tokens`, :func:`decode_sglang_base64` or
            :func:`~megatron_ext.replay.rollout_routes.decode_routed_experts`.
    """
    if isinstance(record, list):
        raise ValueError(
            f"{name}: a JSON list (a batched /generate answer?); write one response per line"
        )
    meta = record.get("meta_info") if isinstance(record, dict) else None
    if not isinstance(meta, dict) or "routed_experts" not in meta:
        raise ValueError(
            f"{name}: a --format sglang record needs meta_info.routed_experts (an SGLang "
            "/generate response, or a sample with tokens beside meta_info)"
        )
    num_tokens = sglang_num_tokens(record, name)
    payload, where = meta["routed_experts"], f"{name} meta_info.routed_experts"
    if payload is None:
        raise ValueError(
            f"{where} is null: start the server with --enable-return-routed-experts and send "
            "return_routed_experts with the request"
        )
    if isinstance(payload, str):
        return (
            decode_sglang_base64(payload, num_tokens, num_layers=num_layers, topk=topk, name=where),
            num_tokens,
        )
    return decode_routed_experts(payload, where), num_tokens
