"""Test encoders: what vLLM and SGLang return for given routes, written from their released source
(read from the wheels, never run; each function cites the files it follows).

Every encoder starts from the engine's capture buffer as the engine fills it: one row per token
and *decoder* layer, zeroed at allocation, written by the MoE layers only, so a dense layer's rows
stay zero (vLLM 0.34 ``model_executor/layers/fused_moe/routed_experts_capturer.py``
``torch.zeros((max_num_batched_tokens, num_layers, topk), dtype=torch.int32)`` with ``num_layers
= get_total_num_hidden_layers()``; SGLang 0.5.23 ``state_capturer/base.py`` ``BaseHostCache``
``buffer.zero_()`` of ``(num_tokens, num_layers, topk_size)`` int32, ``num_layers =
num_hidden_layers``). vLLM 0.21 captured the MoE layers only (``_count_moe_layers``).

Legend: T tokens of a document, P prompt tokens, C completion tokens, N decoder layers, L MoE
layers, K top-k, E experts.
"""

import base64
import io

import numpy as np


def capture_buffer(moe_TLK: np.ndarray, moe_layer_ids: list[int], num_decoder: int) -> np.ndarray:
    """The engines' int32 capture rows ``[T, N, K]``: MoE layers written, dense layers zero."""
    buffer = np.zeros((moe_TLK.shape[0], num_decoder, moe_TLK.shape[2]), dtype=np.int32)
    buffer[:, moe_layer_ids] = moe_TLK
    return buffer


def vllm_numpy2base64(array: np.ndarray) -> str:
    """vLLM 0.34 ``utils/serial_utils.py`` ``numpy2base64``: ``np.save(buffer, array,
    allow_pickle=False)`` into a ``BytesIO``, base64 of the whole buffer (``pybase64.b64encode``
    gives the standard alphabet, as ``base64.b64encode``)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def vllm034_rows(buffer_TNK: np.ndarray, num_prompt: int, num_experts: int, prompt_start: int):
    """One request's ``routed_experts`` array in vLLM 0.34: rows ``[S, T - 1)`` with ``S =
    min(routed_experts_prompt_start, P)`` (``distributed/aux_output_connector/connector.py``:
    ``scheduled_requests[...] = max(min(prompt_start, num_prompt_tokens), ...)``, ``take_output``
    ends at ``request.num_tokens - 1``), stored as uint8 for E <= 256 else uint16
    (``RoutedExpertsCapturer.output_dtype_name``)."""
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    start = min(prompt_start, num_prompt)
    return buffer_TNK[start : buffer_TNK.shape[0] - 1].astype(dtype)


def vllm034_response(
    api: str, prompt: list[int], completions: list[list[int]], rows: list[np.ndarray]
) -> dict:
    """A vLLM 0.34 ``CompletionResponse`` (``api="completion"``) or ``ChatCompletionResponse``
    (``"chat"``) with ``return_token_ids: true``, as serialized: ``entrypoints/openai/completion/
    serving.py`` puts ``prompt_token_ids`` and ``token_ids`` (``as_list(output.token_ids)``, the
    completion only) on each choice; ``chat_completion/serving.py`` puts ``prompt_token_ids`` on
    the response and ``token_ids`` on each choice; both set ``routed_experts =
    numpy2base64(output.routed_experts)``."""
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": sum(map(len, completions)),
        "total_tokens": len(prompt) + sum(map(len, completions)),
    }
    choices = []
    for i, (ids, r) in enumerate(zip(completions, rows, strict=True)):
        choice = {"index": i, "finish_reason": "length", "stop_reason": None, "token_ids": ids}
        choice["routed_experts"] = vllm_numpy2base64(r)
        if api == "completion":
            choice.update(text="...", logprobs=None, prompt_logprobs=None, prompt_token_ids=prompt)
        else:
            choice.update(message={"role": "assistant", "content": "..."}, logprobs=None)
        choices.append(choice)
    response = {"id": "x", "created": 0, "model": "m", "choices": choices, "usage": usage}
    if api == "completion":
        return {**response, "object": "text_completion"}
    return {**response, "object": "chat.completion", "prompt_token_ids": prompt}


def vllm021_count_moe_layers(config: dict) -> int:
    """vLLM 0.21.0 ``model_executor/layers/fused_moe/routed_experts_capturer.py``
    ``_count_moe_layers(hf_config)``: the capture buffer's rows per token. ``layers_block_type``'s
    "moe" count; else with ``decoder_sparse_step > 1`` the layers ``(i + 1) % step == 0`` not in
    ``mlp_only_layers``; else every layer minus ``mlp_only_layers`` (``first_k_dense_replace`` and
    ``moe_layer_freq`` are not read: a DeepSeek config counts every layer)."""
    if config.get("layers_block_type") is not None:
        return config["layers_block_type"].count("moe")
    n = config["num_hidden_layers"]
    mlp_only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1) or 1
    if step > 1:
        return sum(1 for i in range(n) if (i + 1) % step == 0 and i not in mlp_only)
    return n - sum(1 for i in mlp_only if 0 <= i < n)


def vllm021_capture_buffer(moe_TLK: np.ndarray, config: dict) -> np.ndarray:
    """vLLM 0.21.0's capture rows ``[T, _count_moe_layers, K]``: zeroed, and the j-th MoE layer
    writes row ``FusedMoE.moe_layer_id`` (``layers/fused_moe/layer.py``: ``self.moe_layer_id =
    FusedMoE._next_moe_layer_id; FusedMoE._next_moe_layer_id += 1`` in ``__init__``, so the MoE
    layers in the order the model builds them, j; ``bind_routing_capture_to_model`` binds
    ``buffer[module.moe_layer_id]``). For a config it counts right that is exactly the MoE rows;
    for DeepSeek's ``first_k_dense_replace`` the MoE rows first, then zero rows."""
    counted = vllm021_count_moe_layers(config)
    buffer = np.zeros((moe_TLK.shape[0], counted, moe_TLK.shape[2]), dtype=np.int32)
    for moe_layer_id in range(moe_TLK.shape[1]):  # FusedMoE constructed in layer order
        buffer[:, moe_layer_id] = moe_TLK[:, moe_layer_id]
    return buffer


def vllm021_response(
    prompt: list[int],
    completions: list[list[int]],
    moe_rows: list[np.ndarray],
    fingerprint: str | None = None,
) -> dict:
    """A vLLM 0.21 ``ChatCompletionResponse``: ``v1/engine/output_processor.py`` splits each
    request's ``[T - 1, L, K]`` routing (int16, ``_RoutedExpertsDeviceCache.DTYPE``) with
    ``split_routed_experts(routed_experts, prompt_len, num_gen)``: ``prompt_routed_experts =
    routed_experts[:prompt_len]`` (on the response, shared by the choices) and each choice's
    ``routed_experts[prompt_len:]``, clipped to the output length; an empty part is ``None``;
    ``chat_completion/serving.py`` sends both as ``.tolist()``, and the server's
    ``system_fingerprint`` (``entrypoints/openai/fingerprint.py``: ``vllm-<version>-<hash8>`` by
    default; ``None`` with ``--fingerprint-mode none``)."""
    choices = []
    for i, (ids, r) in enumerate(zip(completions, moe_rows, strict=True)):
        gen = r.astype(np.int16)[len(prompt) :][: len(ids)]
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": "..."},
                "token_ids": ids,
                "routed_experts": gen.tolist() if gen.size else None,
            }
        )
    pre = moe_rows[0].astype(np.int16)[: len(prompt)]
    return {
        "id": "x",
        "object": "chat.completion",
        "prompt_routed_experts": pre.tolist() if pre.size else None,
        "model": "m",
        "choices": choices,
        "prompt_token_ids": prompt,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(map(len, completions))},
        "system_fingerprint": fingerprint,
    }


def sglang_base64(buffer_TNK: np.ndarray, start_len: int) -> str:
    """SGLang 0.5.23's ``meta_info["routed_experts"]``: ``state_capturer/base.py`` ``get_topk``
    takes the rows ``[start_len, seqlen - 1)`` (``start_len = min(start_len, seqlen - 1)``) of
    the int32 host cache; ``managers/detokenizer_manager.py`` ``_b64_encode_per_request`` sends
    ``pybase64.b64encode(item.numpy().tobytes())``."""
    start = min(start_len, buffer_TNK.shape[0] - 1)
    rows = np.ascontiguousarray(buffer_TNK[start : buffer_TNK.shape[0] - 1], dtype=np.int32)
    return base64.b64encode(rows.tobytes()).decode("utf-8")


def sglang_generate(prompt: list[int], output: list[int], routed_experts: str) -> dict:
    """A ``/generate`` answer: ``managers/tokenizer_manager.py`` builds ``meta_info`` with
    ``prompt_tokens`` and ``completion_tokens`` (``len(output_ids)``) and ``routed_experts``."""
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": len(output)},
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output),
        "cached_tokens": 0,
        "routed_experts": routed_experts,
    }
    return {"text": "...", "output_ids": output, "meta_info": meta}


def sglang_openai_chat(
    prompt: list[int], outputs: list[list[int]], routes: list[str], meta_per_choice: bool
) -> dict:
    """An OpenAI-compatible ``ChatCompletionResponse`` (``entrypoints/openai/serving_chat.py``
    ``_build_chat_response``, ``protocol.py``): with ``return_meta_info`` each choice carries its
    own ``meta_info`` (and ``sglext.routed_experts`` is left out); otherwise
    ``sglext.routed_experts`` holds the *first* choice's routes (``process_routed_experts_from_ret
    (first_ret, request)``). ``return_token_ids`` puts ``prompt_token_ids`` and
    ``response_token_ids`` on each choice."""
    choices = []
    for i, (ids, r) in enumerate(zip(outputs, routes, strict=True)):
        choice = {
            "index": i,
            "message": {"role": "assistant", "content": "..."},
            "finish_reason": "length",
            "prompt_token_ids": prompt,
            "response_token_ids": ids,
        }
        if meta_per_choice:
            choice["meta_info"] = sglang_generate(prompt, ids, r)["meta_info"]
        choices.append(choice)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(map(len, outputs))}
    response = {"id": "x", "object": "chat.completion", "model": "m", "choices": choices}
    response["usage"] = usage
    if not meta_per_choice:
        response["sglext"] = {"routed_experts": routes[0]}
    return response
