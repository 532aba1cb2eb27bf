"""vLLM's routed experts as its OpenAI-compatible server returns them -> route documents (pure
numpy, never imports megatron).

vLLM 0.34 sends each choice's ``routed_experts`` as base64 of a whole ``.npy`` file, one row per
decoder layer; vLLM 0.21 sends nested lists of the MoE layers' rows, split into the response's
prompt rows and each choice's completion rows (docs/replay.md, "Converting rollouts"). Each
choice is one document, ``T = P + C`` (0.34, N = 2 decoder layers, K = 1, P = 2, C = 2)::

    {"prompt_token_ids": [5, 6], "choices": [{"token_ids": [7, 8],
     "routed_experts": b64(np.save([[[0], [3]], [[0], [1]], [[0], [2]]]))}]}
    -> one document, T = 4, rows for tokens 0..2 (the last token was never fed forward)

Legend: T tokens of a document, P prompt tokens, C completion tokens, N decoder layers, L MoE
layers, K top-k.
"""

import base64
import binascii
import io
import re
from typing import Any

import numpy as np

from megatron_ext.replay.rollout_routes import (
    RolloutDocument,
    check_route_array,
    decode_routed_experts,
)

#: Request parameter (vLLM >= 0.34) whose value a record may carry beside the response.
PROMPT_START_KEY = "routed_experts_prompt_start"
#: ``system_fingerprint`` of vLLM's OpenAI-compatible server: ``vllm-<version>[-tp2...]-<hash8>``
#: by default (0.21's ``entrypoints/openai/fingerprint.py``).
_FINGERPRINT = re.compile(r"vllm-(\d+)\.(\d+)(?:[.\-+]|rc|$)")


def moe_rows_first(record: dict, mode: str = "auto") -> bool:
    """Whether a vLLM answer's decoder-layer rows hold the MoE layers first (vLLM 0.21).

    ``mode``: ``--vllm-moe-rows`` (``first`` / ``decoder`` decide; ``auto`` reads the response).
    """
    # vLLM 0.34 writes row i for decoder layer i; 0.21 the MoE layers' rows first
    # (FusedMoE.moe_layer_id), then zero rows where its _count_moe_layers misreads the config
    # (DeepSeek's first_k_dense_replace; moe_layer_map). Decided by the engine version, else by
    # 0.21's split form (prompt_routed_experts, absent from 0.34's protocol); never by which rows
    # are zero.
    if mode != "auto":
        return mode == "first"
    fingerprint = record.get("system_fingerprint")
    match = _FINGERPRINT.match(fingerprint) if isinstance(fingerprint, str) else None
    if match:
        return (int(match.group(1)), int(match.group(2))) == (0, 21)
    return "prompt_routed_experts" in record


def decode_npy_base64(text: str, name: str) -> np.ndarray:
    """vLLM 0.34's ``numpy2base64`` string -> the array (ValueError naming ``name`` for bad
    base64, not a ``.npy`` file, or not a 3-D integer array)."""
    # utils/serial_utils.py numpy2base64 is np.save(buffer, array, allow_pickle=False), base64'd
    # whole: a complete .npy file (uint8 up to 256 experts, else uint16: routed_experts_capturer's
    # output_dtype_name). Dtype and shape come from its header, never from the byte count.
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{name}: not valid base64 ({err})") from err
    if not raw.startswith(b"\x93NUMPY"):
        raise ValueError(
            f"{name}: the base64 does not hold a .npy file (vLLM >= 0.34 sends np.save bytes; "
            "SGLang's raw int32 bytes are --format sglang)"
        )
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{name}: not a readable .npy payload ({err})") from err
    check_route_array(array, name)
    return array


def decode_vllm_routes(payload: Any, name: str, may_hold_booleans: bool = True) -> np.ndarray:
    """A ``routed_experts`` value of any vLLM form: ``.npy`` base64 string (0.34), nested lists
    (0.21) or the ``{"data", "shape", "dtype"}`` object of prime-rl."""
    if isinstance(payload, str):
        return decode_npy_base64(payload, name)
    return decode_routed_experts(payload, name, may_hold_booleans=may_hold_booleans)


def _ids(value: Any, where: str) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of token ids, got {type(value).__name__}")
    return value


def _prompt_start(record: dict, default: int, name: str) -> int:
    value = record.get(PROMPT_START_KEY, default)
    if type(value) is not int or value < 0:
        raise ValueError(
            f"{name}: {PROMPT_START_KEY} must be a non-negative integer, got {value!r}"
        )
    return value


def vllm_response_documents(
    response: dict, name: str, *, prompt_start: int = 0, vllm_moe_rows: str = "auto"
) -> list[RolloutDocument]:
    """One vLLM ``CompletionResponse`` / ``ChatCompletionResponse`` -> a document per choice.

    Args:
        response: The parsed response (``choices`` present).
        name: ``file:line``.
        prompt_start: The requests' ``routed_experts_prompt_start`` (``--routed-experts-start``);
            a ``routed_experts_prompt_start`` key in the record overrides it.
        vllm_moe_rows: ``--vllm-moe-rows`` (:func:`moe_rows_first`).

    ValueError naming the choice: no routes or token ids, or 0.21 prompt rows that do not fit.
    """
    choices = response["choices"]
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"{name}: 'choices' must be a non-empty list")
    start = _prompt_start(response, prompt_start, name)
    shared_prompt = _ids(response.get("prompt_token_ids"), f"{name} prompt_token_ids")
    prompt_rows = response.get("prompt_routed_experts")  # vLLM 0.21's split form
    if prompt_rows is not None:
        prompt_rows = decode_routed_experts(prompt_rows, f"{name} prompt_routed_experts")
    first = moe_rows_first(response, vllm_moe_rows)
    documents = []
    for i, choice in enumerate(choices):
        where = f"{name} choice {i}"
        prompt, completion = _choice_tokens(choice, shared_prompt, where)
        if "prompt_routed_experts" in response:  # vLLM 0.21
            rows = _split_form_rows(choice.get("routed_experts"), prompt_rows, len(prompt), where)
            start_row = 0
        else:
            rows = _npy_rows(choice.get("routed_experts"), where)
            # The array is [T - 1 - start, N, K], start = min(routed_experts_prompt_start, P)
            # (distributed/aux_output_connector/connector.py).
            start_row = min(start, len(prompt))
        documents.append(
            RolloutDocument(
                where,
                rows,
                len(prompt) + len(completion),
                start=start_row,
                token_ids=prompt + completion,
                num_prompt=len(prompt),
                moe_rows_first=first,
                fields=(choice, response),
            )
        )
    return documents


def _choice_tokens(choice: Any, shared_prompt: list | None, where: str) -> tuple[list, list]:
    """A choice's prompt and completion token ids."""
    if not isinstance(choice, dict):
        raise ValueError(f"{where}: not a JSON object")
    # A chat response carries prompt_token_ids at response level, a completion response on each
    # choice; a choice's token_ids is its completion only (both need return_token_ids: true).
    prompt = _ids(choice.get("prompt_token_ids"), f"{where} prompt_token_ids") or shared_prompt
    completion = _ids(choice.get("token_ids"), f"{where} token_ids")
    if prompt is None or completion is None:
        raise ValueError(
            f"{where}: needs prompt_token_ids and the choice's token_ids to count its tokens; "
            "send the request with return_token_ids: true"
        )
    return prompt, completion


def _npy_rows(payload: Any, where: str) -> np.ndarray:
    """vLLM 0.34: a choice's own ``routed_experts``."""
    if payload is None:
        raise ValueError(
            f"{where} has no routed_experts (start vLLM with --enable-return-routed-experts; "
            "an aborted request has none)"
        )
    return decode_vllm_routes(payload, f"{where} routed_experts")


def _split_form_rows(
    payload: Any, prompt_rows: np.ndarray | None, num_prompt: int, where: str
) -> np.ndarray:
    """vLLM 0.21 (``v1/engine/output_processor.py`` ``split_routed_experts``): the response's
    prompt rows (shared by the ``n`` choices) then the choice's ``routed_experts``."""
    if payload is not None and not isinstance(payload, list):
        raise ValueError(
            f"{where}: prompt_routed_experts (vLLM 0.21) beside a non-list "
            "routed_experts: not one vLLM version's answer"
        )
    gen = decode_routed_experts(payload or [], f"{where} routed_experts")  # an empty part is null
    if prompt_rows is None and payload is None:
        raise ValueError(
            f"{where}: prompt_routed_experts and routed_experts are null "
            "(start vLLM with --enable-return-routed-experts)"
        )
    return _join_split(prompt_rows, gen, num_prompt, where)


def _join_split(
    prompt_PLK: np.ndarray | None, gen_CLK: np.ndarray, num_prompt: int, where: str
) -> np.ndarray:
    """vLLM 0.21: the prompt's rows (``None`` for an empty prompt) then the completion's."""
    if prompt_PLK is None or prompt_PLK.shape == (0, 0, 0):
        prompt_PLK = np.zeros((0, *gen_CLK.shape[1:]), dtype=np.int64)
    if gen_CLK.shape == (0, 0, 0):
        gen_CLK = np.zeros((0, *prompt_PLK.shape[1:]), dtype=np.int64)
    if prompt_PLK.shape[0] != num_prompt:
        raise ValueError(
            f"{where}: prompt_routed_experts has {prompt_PLK.shape[0]} rows for {num_prompt} "
            "prompt tokens (a completion request with several prompts returns the first "
            "prompt's rows only: send one prompt per request)"
        )
    if prompt_PLK.shape[1:] != gen_CLK.shape[1:]:
        raise ValueError(
            f"{where}: prompt_routed_experts [.., {prompt_PLK.shape[1]}, {prompt_PLK.shape[2]}] "
            f"and routed_experts [.., {gen_CLK.shape[1]}, {gen_CLK.shape[2]}] differ in layers x top-k"
        )
    return np.concatenate([prompt_PLK.astype(np.int64), gen_CLK.astype(np.int64)])
