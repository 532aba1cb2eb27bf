"""Which decoder layers of a model are MoE layers, and selecting their rows from an engine's
per-decoder-layer route dump (pure numpy + json, never imports megatron).

vLLM (0.34, ``model_executor/layers/fused_moe/routed_experts_capturer.py``: ``num_layers =
model_config.get_total_num_hidden_layers()``) and SGLang (0.5.23, ``state_capturer/routed_experts.py``:
``num_layers = hf_text_config.num_hidden_layers``) return one row per *decoder* layer. Their
capture buffers are zeroed when allocated (``torch.zeros``; SGLang's host cache ``zero_()``,
``state_capturer/base.py``) and only MoE layers write to them, so a dense layer's row is all zeros.
Training needs the MoE rows only. A :class:`MoeLayerMap` names them (0-based decoder-layer
indices), from ``--moe-layer-ids`` or from the model's Hugging Face ``config.json`` by the rules
the engines build their layers with:

- DeepSeek-V2/V3, Kimi-K2, GLM-4.5 (vLLM ``models/deepseek_v2.py``, ``models/glm4_moe.py``):
  layer i is MoE iff ``n_routed_experts`` is set, ``i >= first_k_dense_replace`` and
  ``i % moe_layer_freq == 0`` (``moe_layer_freq`` defaults to 1);
- Qwen2-MoE / Qwen3-MoE (``models/qwen3_moe.py``): iff ``i not in mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``;
- Nemotron-H style ``layers_block_type`` lists: iff the entry is ``"moe"``;
- otherwise (Mixtral and the like) every decoder layer is MoE.

vLLM 0.21 is the exception (``model_executor/layers/fused_moe/routed_experts_capturer.py``): it
sizes its buffer with ``_count_moe_layers(hf_text_config)``, which knows ``layers_block_type``,
``decoder_sparse_step`` and ``mlp_only_layers`` but not DeepSeek's ``first_k_dense_replace`` (it
counts every layer MoE), and writes layer rows at ``FusedMoE.moe_layer_id``, a class counter
incremented per constructed ``FusedMoE`` (``layers/fused_moe/layer.py``), i.e. the MoE layers in
order. For such a config its rows are the MoE layers first, then zero rows; for configs it counts
right, exactly the MoE rows. :func:`select_moe_rows` takes ``moe_rows_first`` from the engine
version (the response's ``system_fingerprint``, ``vllm-0.21.0-...``, or 0.21's split form) or
``--vllm-moe-rows first``; never from which rows are zero.

Worked example (DeepSeek-style, 5 layers, ``first_k_dense_replace = 2``, K = 2)::

    dump row of a token  [[0 0] [0 0] [3 7] [1 2] [6 0]]   (decoder layers 0..4)
    moe_layer_ids (2, 3, 4) -> MoE rows [[3 7] [1 2] [6 0]]; layers 0 and 1 must be all zero
    vLLM 0.21 row of a token [[3 7] [1 2] [6 0] [0 0] [0 0]]  (MoE rows first, then 2 zero rows)
    moe_rows_first           -> MoE rows [[3 7] [1 2] [6 0]]; rows 3 and 4 must be all zero

Legend: T tokens, L MoE layers, N decoder layers, K top-k.
"""

import dataclasses
import json
from typing import Any

import numpy as np

#: Hugging Face config keys holding the routed expert count / top-k (vLLM 0.34's
#: ``transformers_utils/config.py`` ``CONFIG_FIELD_ALIASES``, first match wins).
EXPERT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk")
#: ``--vllm-moe-rows``: how a vLLM dump of N decoder-layer rows orders them.
VLLM_MOE_ROWS = ("auto", "decoder", "first")


@dataclasses.dataclass(frozen=True)
class MoeLayerMap:
    """The MoE layers among a model's decoder layers."""

    num_decoder_layers: int | None
    """N, the rows per token an engine dumps; None when only the MoE ids are known."""
    moe_layer_ids: tuple[int, ...]
    """0-based decoder-layer indices of the MoE layers, increasing."""
    topk: int | None = None
    """K from the model config (None when given by ids)."""
    num_experts: int | None = None
    """E from the model config (None when given by ids)."""


def parse_layer_ids(text: str, flag: str = "--moe-layer-ids") -> tuple[int, ...]:
    """``"3,4,5"`` or ranges ``"3-60"`` -> ``(3, 4, 5)``; distinct, increasing, non-negative.

    Raises:
        ValueError: Anything else, naming ``flag``.
    """
    ids: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            values = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        except ValueError as err:
            raise ValueError(
                f"{flag} {text!r}: {part.strip()!r} is not an integer or a range a-b"
            ) from err
        ids.extend(values)
    if not ids or min(ids) < 0 or ids != sorted(set(ids)):
        raise ValueError(f"{flag} {text!r}: give distinct increasing non-negative layer indices")
    return tuple(ids)


def _first(config: dict, keys: tuple[str, ...]) -> Any:
    return next((config[key] for key in keys if config.get(key) is not None), None)


def moe_layer_ids_from_config(config: dict, name: str) -> tuple[int, ...]:
    """The 0-based MoE decoder layers of a Hugging Face text config (rules in the module doc)."""
    num_layers = config.get("num_hidden_layers")
    if type(num_layers) is not int or num_layers < 1:
        raise ValueError(
            f"{name}: 'num_hidden_layers' must be a positive integer, got {num_layers!r}"
        )
    block_types = config.get("layers_block_type")
    if isinstance(block_types, list):
        if len(block_types) != num_layers:  # the engines dump one row per hidden layer
            raise ValueError(
                f"{name}: 'layers_block_type' lists {len(block_types)} layers, "
                f"'num_hidden_layers' is {num_layers}"
            )
        return tuple(i for i, kind in enumerate(block_types) if kind == "moe")
    if "first_k_dense_replace" in config:
        first = config["first_k_dense_replace"]
        freq = config.get("moe_layer_freq", 1)
        if type(first) is not int or type(freq) is not int or first < 0 or freq < 1:
            raise ValueError(f"{name}: first_k_dense_replace / moe_layer_freq must be integers")
        if config.get("n_routed_experts") is None:
            return ()
        return tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    mlp_only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1) or 1
    if not isinstance(mlp_only, list) or type(step) is not int or step < 1:
        raise ValueError(f"{name}: mlp_only_layers must be a list, decoder_sparse_step an integer")
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def read_model_config(path: str) -> MoeLayerMap:
    """A :class:`MoeLayerMap` (with K and E) from a Hugging Face ``config.json``.

    A multimodal config's ``text_config`` is the decoder's. Raises ValueError naming ``path``
    for an unreadable file or a config without MoE layers.
    """
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--model-config {path}: not a readable JSON config ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {path}: not a JSON object")
    if isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    name = f"--model-config {path}"
    ids = moe_layer_ids_from_config(config, name)
    if not ids:
        raise ValueError(f"{name}: the config describes no MoE layer")
    topk, experts = _first(config, TOPK_KEYS), _first(config, EXPERT_KEYS)
    for key, value in (("top-k", topk), ("expert count", experts)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name}: no positive integer {key} ({value!r})")
    return MoeLayerMap(config["num_hidden_layers"], ids, topk=topk, num_experts=experts)


def select_moe_rows(
    rows_TNK: np.ndarray, layer_map: MoeLayerMap, name: str, moe_rows_first: bool = False
) -> np.ndarray:
    """The MoE layers' rows of a dump, after checking every other row is all zero.

    A dump of ``len(moe_layer_ids)`` layers is taken as MoE rows already (vLLM 0.21's split
    form for configs it counts right, Megatron inference); one of N decoder layers is selected:
    row i is decoder layer i, or, with ``moe_rows_first`` (vLLM 0.21, module doc), the MoE
    layers' rows come first in order and the rest are zero. The engines leave the rows no MoE
    layer writes zero: a non-zero one means the layer map (or the row order) is not the dump's.

    Raises:
        ValueError: Another layer count, or a non-zero row where zeros belong (naming its
            layer and token, and both possible causes).
    """
    num_moe, num_rows = len(layer_map.moe_layer_ids), rows_TNK.shape[1]
    if num_rows == num_moe:
        return rows_TNK
    if num_rows != layer_map.num_decoder_layers:
        decoder = (
            ""
            if layer_map.num_decoder_layers is None
            else f" or the model's {layer_map.num_decoder_layers} decoder layers"
        )
        raise ValueError(
            f"{name}: rows of {num_rows} layers, neither the {num_moe} MoE layers{decoder} "
            "(--moe-layer-ids / --model-config)"
        )
    if moe_rows_first:
        moe = list(range(num_moe))
        zero = np.arange(num_moe, num_rows)
    else:
        moe = list(layer_map.moe_layer_ids)
        zero = np.setdiff1d(np.arange(num_rows), moe)
    nonzero_TD = (rows_TNK[:, zero] != 0).any(-1)
    if nonzero_TD.any():
        token, d = (int(v) for v in np.argwhere(nonzero_TD)[0])
        layer = int(zero[d])
        held = rows_TNK[token, layer].tolist()
        if moe_rows_first:
            raise ValueError(
                f"{name}: token {token}, row {layer} holds experts {held}, but a vLLM 0.21 dump "
                f"of this model has its {num_moe} MoE rows first and zeros after them: not vLLM "
                "0.21's row order (--vllm-moe-rows decoder reads row i as decoder layer i) or "
                "not this model's layer map (--moe-layer-ids / --model-config)"
            )
        raise ValueError(
            f"{name}: token {token}, decoder layer {layer} is dense by the layer map but holds "
            f"experts {held} (engines leave dense rows zero): either the layer map is not the "
            "model's (--moe-layer-ids / --model-config), or the dump is vLLM 0.21's, whose rows "
            "are the MoE layers first for configs its _count_moe_layers misreads "
            "(first_k_dense_replace): pass --vllm-moe-rows first"
        )
    return rows_TNK[:, moe]
