"""SGLang ``return_routed_experts`` answers -> route documents (pure numpy, never imports megatron).

SGLang 0.5.23 (what slime and miles replay from) sends base64 of raw int32 ids ``[T - 1 - start, N,
K]``, every decoder layer, with no shape or dtype: in ``/generate``'s ``meta_info``, or an
OpenAI-compatible response's ``sglext`` (first choice only) or per-choice ``meta_info``
(docs/replay.md, "Converting rollouts"). N = 1, K = 2::

    {"meta_info": {"prompt_tokens": 2, "completion_tokens": 1,
                   "routed_experts": base64(int32 [[[1, 4]], [[0, 2]]])}}
    -> rows [[1 4]] [[0 2]] and T = 3 (repair_document appends the missing T-th row)

Legend: T tokens of a document, L MoE layers, K top-k.
"""

import base64
import binascii
from typing import Any

import numpy as np

from megatron_ext.replay.rollout_routes import RolloutDocument, decode_routed_experts

#: SGLang's dtype for routed expert ids (its capturer's int32 buffers), little-endian on the wire.
SGLANG_DTYPE = np.dtype("<i4")
#: Request parameter whose value a record may carry beside the response.
START_KEY = "routed_experts_start_len"
#: A ``/generate`` answer's prompt ids (the request's ``return_prompt_token_ids``) and completion
#: ids (``managers/tokenizer_manager.py``: ``out_dict["prompt_token_ids"]``, ``"output_ids"``).
GENERATE_ID_KEYS = ("prompt_token_ids", "output_ids")


def _count(meta: dict, key: str, name: str) -> int:
    value = meta[key]
    if type(value) is not int or value < 0:
        raise ValueError(
            f"{name}: meta_info.{key} must be a non-negative integer, got {value!r:.40}"
        )
    return value


def sglang_num_tokens(record: dict, name: str) -> int | None:
    """T of one record: ``prompt_tokens + completion_tokens`` and/or the sample's token list, which
    must agree (neither wins; ValueError); None when neither is given."""
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
    data: str, num_tokens: int | None, *, num_layers: int, topk: int, name: str, start: int = 0
) -> np.ndarray:
    """SGLang's base64 int32 payload -> ``[rows, N, K]`` int32 rows, exactly: whole rows of
    ``N * K``; with T known, exactly ``T - 1 - start`` of them (ValueError saying what it holds)."""
    # managers/tokenizer_manager.py: pybase64.b64encode(val.numpy().tobytes()), decoded by
    # state_capturer/routed_experts.py's extract_routed_experts_from_meta_info as np.int32;
    # state_capturer/base.py get_topk: rows [start_len, seqlen - 1). The element type is fixed
    # by the format, N and K come from the caller: the row count is never read off the bytes.
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{name}: not valid base64 ({err})") from err
    if len(raw) % SGLANG_DTYPE.itemsize:
        raise ValueError(f"{name}: {len(raw)} bytes are not whole int32 expert ids")
    ids = np.frombuffer(raw, dtype=SGLANG_DTYPE)
    per_row = num_layers * topk
    rows, extra = divmod(ids.size, per_row)
    want_rows = None if num_tokens is None else max(num_tokens - 1 - start, 0)
    if extra or (want_rows is not None and rows != want_rows):
        minus = f" - {start}" if start else ""  # the start offset, when there is one
        want = "whole rows" if want_rows is None else f"T - 1{minus} = {want_rows} rows"
        hint = ""
        if want_rows and ids.size % (want_rows * topk) == 0:
            layers = ids.size // (want_rows * topk)
            hint = (
                f"; that is {layers} layers x top-{topk} per row (SGLang records every decoder "
                "layer: give --moe-layer-ids or --model-config for a model with dense layers)"
            )
        raise ValueError(
            f"{name}: {ids.size} int32 ids are not {want} of {num_layers} layers x top-{topk}{hint}"
        )
    return ids.reshape(rows, num_layers, topk)


def _start_len(record: dict, default: int, name: str) -> int:
    value = record.get(START_KEY, default)
    if type(value) is not int or value < 0:
        raise ValueError(f"{name}: {START_KEY} must be a non-negative integer, got {value!r}")
    return value


def _document(
    meta: dict,
    record: dict,
    *,
    num_layers: int,
    topk: int,
    name: str,
    start_len: int,
    token_ids: list | None = None,
    fields: tuple[dict, ...] = (),
) -> RolloutDocument:
    """One ``meta_info`` (and the sample fields beside it) -> a document; ``token_ids``: the ids
    of an OpenAI-compatible answer; ``fields``: the objects describing it, before ``record``."""
    num_tokens = sglang_num_tokens({**record, "meta_info": meta}, name)
    payload, where = meta["routed_experts"], f"{name} meta_info.routed_experts"
    if payload is None:
        raise ValueError(
            f"{where} is null: start the server with --enable-return-routed-experts and send "
            "return_routed_experts with the request"
        )
    # start_len = min(routed_experts_start_len, seqlen - 1), as get_topk takes it.
    start = start_len if num_tokens is None else min(start_len, max(num_tokens - 1, 0))
    ids = next((record[k] for k in ("tokens", "token_ids") if k in record), token_ids)
    if ids is None and all(isinstance(record.get(k), list) for k in GENERATE_ID_KEYS):
        ids = record["prompt_token_ids"] + record["output_ids"]  # /generate's own ids
    prompt = meta.get("prompt_tokens")
    split = {
        "token_ids": ids,
        "num_prompt": prompt if type(prompt) is int else None,
        "fields": (*fields, record, meta),
    }
    if isinstance(payload, str):  # some dumps keep the value as nested lists instead
        rows = decode_sglang_base64(
            payload, num_tokens, num_layers=num_layers, topk=topk, name=where, start=start
        )
        return RolloutDocument(name, rows, num_tokens, start=start, exact=True, **split)
    rows = decode_routed_experts(payload, where)
    return RolloutDocument(name, rows, num_tokens, start=start, **split)


def decode_sglang_record(
    record: Any, *, num_layers: int, topk: int, name: str, start_len: int = 0
) -> list[RolloutDocument]:
    """One SGLang answer or sample -> its documents for ``repair_document``.

    ``record``: a ``/generate`` response (or a sample with ``tokens``/``token_ids`` beside its
    ``meta_info``) or an OpenAI-compatible one; ``num_layers`` N (the base64 has no shape);
    ``start_len``: ``--routed-experts-start``, a record's own key overriding it. ValueError for
    a record without routes, or a payload or count refused.
    """
    # In a multi-turn rollout each turn's value covers the whole sequence so far (unless
    # routed_experts_start_len was set): the last turn's record is the one to keep.
    if not isinstance(record, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(record).__name__}")
    start_len = _start_len(record, start_len, name)
    shape = {"num_layers": num_layers, "topk": topk, "start_len": start_len}
    if isinstance(record.get("meta_info"), dict) and "routed_experts" in record["meta_info"]:
        return [_document(record["meta_info"], record, name=name, **shape)]
    if isinstance(record.get("choices"), list):
        return _openai_documents(record, name, shape)
    raise ValueError(
        f"{name}: a --format sglang record needs meta_info.routed_experts (an SGLang /generate "
        "response, or a sample with tokens beside meta_info) or sglext.routed_experts (an "
        "OpenAI-compatible response)"
    )


def _openai_documents(response: dict, name: str, shape: dict) -> list[RolloutDocument]:
    """An OpenAI-compatible response: each choice's ``meta_info`` (``return_meta_info``), or
    ``sglext.routed_experts`` with the first choice's tokens (entrypoints/openai/
    serving_{chat,completions}.py, ``protocol.py`` ``SglExt``)."""
    choices = response["choices"]
    metas = [c.get("meta_info") if isinstance(c, dict) else None for c in choices]
    if metas and all(isinstance(m, dict) and "routed_experts" in m for m in metas):
        return [
            _document(
                meta, {}, name=f"{name} choice {i}", token_ids=_choice_ids(c), fields=(c,), **shape
            )
            for i, (meta, c) in enumerate(zip(metas, choices, strict=True))
        ]
    sglext = response.get("sglext")
    if not isinstance(sglext, dict) or "routed_experts" not in sglext:
        raise ValueError(
            f"{name}: an OpenAI-compatible response without sglext.routed_experts (send "
            "return_routed_experts: true; the server needs --enable-return-routed-experts)"
        )
    if len(choices) != 1:
        raise ValueError(
            f"{name}: sglext.routed_experts holds the first of {len(choices)} choices' routes "
            "only: send n = 1, or return_meta_info: true (each choice's meta_info)"
        )
    choice = choices[0] if isinstance(choices[0], dict) else {}
    prompt = sglext.get("input_ids", choice.get("prompt_token_ids"))
    outputs = sglext.get("output_ids")
    completion = outputs[0] if isinstance(outputs, list) and outputs else None
    if completion is None:
        completion = choice.get("token_ids", choice.get("response_token_ids"))
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    ids = None
    if isinstance(prompt, list) and isinstance(completion, list):
        counts = {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}
        ids = prompt + completion
    else:  # one choice: the usage counts are its own
        counts = {k: usage[k] for k in ("prompt_tokens", "completion_tokens") if k in usage}
    meta = {"routed_experts": sglext["routed_experts"], **counts}
    fields = (choice, response)
    return [_document(meta, {}, name=f"{name} sglext", token_ids=ids, fields=fields, **shape)]


def _choice_ids(choice: dict) -> list | None:
    """A choice's prompt + completion ids (``return_token_ids``), or None."""
    prompt = choice.get("prompt_token_ids")
    completion = choice.get("token_ids", choice.get("response_token_ids"))
    if isinstance(prompt, list) and isinstance(completion, list):
        return prompt + completion
    return None
