"""Which decoder layers of a model are MoE layers, and selecting their rows from an engine's
per-decoder-layer route dump (pure numpy + json, never imports megatron).

vLLM and SGLang return one row per *decoder* layer, a dense layer's all zeros; training needs the
MoE rows only. A :class:`MoeLayerMap` names them, from ``--moe-layer-ids`` or a Hugging Face
``config.json``. DeepSeek-style, 5 layers, ``first_k_dense_replace = 2``, K = 2::

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
    """``"3,4,5"`` or ranges ``"3-60"`` -> ``(3, 4, 5)``: distinct, increasing, non-negative
    (ValueError naming ``flag`` otherwise)."""
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
    """The 0-based MoE decoder layers of a Hugging Face text config, by the rules the engines
    build their layers with."""
    num_layers = config.get("num_hidden_layers")
    if type(num_layers) is not int or num_layers < 1:
        raise ValueError(
            f"{name}: 'num_hidden_layers' must be a positive integer, got {num_layers!r}"
        )
    block_types = config.get("layers_block_type")
    if isinstance(block_types, list):  # Nemotron-H style: the entries that are "moe"
        if len(block_types) != num_layers:  # the engines dump one row per hidden layer
            raise ValueError(
                f"{name}: 'layers_block_type' lists {len(block_types)} layers, "
                f"'num_hidden_layers' is {num_layers}"
            )
        return tuple(i for i, kind in enumerate(block_types) if kind == "moe")
    if "first_k_dense_replace" in config:
        # DeepSeek-V2/V3, Kimi-K2, GLM-4.5 (vLLM models/deepseek_v2.py, models/glm4_moe.py):
        # MoE iff n_routed_experts is set, i >= first_k_dense_replace, i % moe_layer_freq == 0.
        first = config["first_k_dense_replace"]
        freq = config.get("moe_layer_freq", 1)
        if type(first) is not int or type(freq) is not int or first < 0 or freq < 1:
            raise ValueError(f"{name}: first_k_dense_replace / moe_layer_freq must be integers")
        if config.get("n_routed_experts") is None:
            return ()
        return tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    # Qwen2-MoE / Qwen3-MoE (models/qwen3_moe.py): MoE iff i not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0; without those keys (Mixtral and the like) every layer.
    mlp_only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1) or 1
    if not isinstance(mlp_only, list) or type(step) is not int or step < 1:
        raise ValueError(f"{name}: mlp_only_layers must be a list, decoder_sparse_step an integer")
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def read_model_config(path: str) -> MoeLayerMap:
    """A :class:`MoeLayerMap` (with K and E) from a Hugging Face ``config.json`` (ValueError
    naming ``path`` for an unreadable file or a config without MoE layers)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--model-config {path}: not a readable JSON config ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"--model-config {path}: not a JSON object")
    if isinstance(config.get("text_config"), dict):  # a multimodal config's decoder
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

    A dump of N decoder layers has row i for decoder layer i, or, with ``moe_rows_first``
    (vLLM 0.21), the MoE layers' rows first, in order. A dump of L rows is taken as MoE rows.

    Raises:
        ValueError: Another layer count, or a non-zero row where zeros belong (naming its
            layer and token, and both possible causes).
    """
    num_moe, num_rows = len(layer_map.moe_layer_ids), rows_TNK.shape[1]
    if num_rows == num_moe:  # vLLM 0.21 for configs it counts right, Megatron inference
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
    # vLLM 0.34 (routed_experts_capturer.py: get_total_num_hidden_layers()) and SGLang 0.5.23
    # (state_capturer/routed_experts.py: num_hidden_layers) zero their capture buffers when
    # allocated (SGLang's host cache zero_(), state_capturer/base.py) and only MoE layers write:
    # a non-zero row where zeros belong means the layer map or the row order is not the dump's.
    # vLLM 0.21 sizes its buffer with _count_moe_layers (blind to first_k_dense_replace) and
    # writes at FusedMoE.moe_layer_id, a counter per constructed layer (layers/fused_moe/layer.py):
    # the MoE rows first, then zero rows.
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
