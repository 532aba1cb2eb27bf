"""Where each route row goes in Megatron's parallel layout (pure torch, never imports megatron).

Route rows are sliced and gathered by the ``b * S + s`` positions each rank's routers hold
(:func:`megatron_ext.common.token_positions.router_row_positions`, shared with pad skipping), and
absolute layer numbers mapped to MoE-layer ordinals (the L axis of a route buffer).

Legend: B samples of a micro-batch, S sequence length, N router rows on this rank, L MoE layers,
K top-k, R ranks gathered.
"""

from collections.abc import Sequence
from typing import Any

import torch

# Megatron 0.19.2's hybrid pattern grammar (megatron/core/models/hybrid/hybrid_layer_allocation.py,
# ``Symbols``): one symbol per layer, '|' between pipeline stages, '/' before each MTP depth's
# pattern. Repeated here so this module stays free of megatron imports.
_HYBRID_LAYER_SYMBOLS = frozenset("MG*D+-E")
_HYBRID_MOE, _HYBRID_PIPE, _HYBRID_MTP = "E", "|", "/"


def rows_for_router(routes_BSLK: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
    """Selects this rank's router rows: ``routes_NLK`` (same dtype, no host sync).

    ``positions_N`` must be on the device of ``routes_BSLK`` (cache it there once per shape).
    """
    batch_size, seq_len = routes_BSLK.shape[:2]
    flat_XLK = routes_BSLK.reshape(batch_size * seq_len, *routes_BSLK.shape[2:])
    return flat_XLK.index_select(0, positions_N)


def stage_rows_layer_major(
    routes_BSLK: torch.Tensor, positions_N: torch.Tensor, lo: int, hi: int
) -> torch.Tensor:
    """This rank's router rows of MoE layers ``[lo, hi)``, layer-major: ``[hi - lo, N, K]``."""
    # One gather (same dtype, no host sync): rows_for_router's selection and the layer-major copy
    # in one kernel, so each layer's rows are then a contiguous slice.
    batch_size, seq_len = routes_BSLK.shape[:2]
    flat_XLK = routes_BSLK.reshape(batch_size * seq_len, *routes_BSLK.shape[2:])
    return flat_XLK[:, lo:hi].transpose(0, 1).index_select(1, positions_N)


def assemble_from_ranks(
    rows_RNLK: torch.Tensor, positions_RN: torch.Tensor, batch_size: int, seq_len: int
) -> torch.Tensor:
    """Inverse of :func:`rows_for_router` over the ranks that split a micro-batch.

    ``rows_RNLK``: each rank's router rows (gathered over the TP and CP groups);
    ``positions_RN``: each rank's ``router_row_positions``. Returns ``routes_BSLK``.
    """
    assert positions_RN.numel() == batch_size * seq_len, "ranks must cover the micro-batch once"
    flat_XLK = torch.empty(
        (batch_size * seq_len, *rows_RNLK.shape[2:]), dtype=rows_RNLK.dtype, device=rows_RNLK.device
    )
    flat_XLK[positions_RN.reshape(-1).to(rows_RNLK.device)] = rows_RNLK.reshape(
        -1, *rows_RNLK.shape[2:]
    )
    return flat_XLK.reshape(batch_size, seq_len, *rows_RNLK.shape[2:])


def moe_layer_numbers_from_hybrid_pattern(pattern: str) -> list[int]:
    """Absolute (1-based) numbers of the MoE (``E``) layers of a ``HybridModel`` decoder.

    Example: ``"*E|*E/*E"`` -> ``[2, 4]``; ValueError for a symbol that is not a layer symbol.
    """
    # Only the main decoder pattern: '|' takes no layer number (HybridStack numbers layers
    # across stages), and MTP patterns after the first '/' route natively.
    main = pattern.split(_HYBRID_MTP, 1)[0]
    bad = sorted(set(main) - _HYBRID_LAYER_SYMBOLS - {_HYBRID_PIPE})
    if bad:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: {bad} not a layer symbol "
            f"(valid: {''.join(sorted(_HYBRID_LAYER_SYMBOLS))}, '|' and '/')"
        )
    layers = main.replace(_HYBRID_PIPE, "")
    return [i + 1 for i, symbol in enumerate(layers) if symbol == _HYBRID_MOE]


def moe_layer_numbers_for_args(args: Any) -> list[int]:
    """MoE layer numbers of the model Megatron's parsed ``args`` describe (a ``HybridModel``'s
    pattern, else a ``GPTModel``'s ``moe_layer_freq``; none without ``--num-experts``)."""
    # The deprecated hybrid_override_pattern too: Megatron's validate_args copies it over later.
    from megatron_ext.config.megatron_view import MegatronView

    view = MegatronView.from_args(args)
    pattern = view.hybrid_layer_pattern or view.hybrid_override_pattern
    if pattern:
        return moe_layer_numbers_from_hybrid_pattern(pattern)
    if not view.num_experts:
        return []
    return moe_layer_numbers(view.num_layers, view.moe_layer_freq)


def moe_layer_numbers(num_layers: int, moe_layer_freq: int | Sequence[int]) -> list[int]:
    """Absolute (1-based) numbers of the MoE layers of the decoder, MTP layers excluded, by
    Megatron's ``moe_layer_freq`` (an int N: every layer index divisible by N, from 0; a list:
    1 (MoE) or 0 (dense) per layer, ``num_layers`` long)."""
    if isinstance(moe_layer_freq, int):
        pattern = [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
        if len(pattern) != num_layers:
            raise ValueError(f"--moe-layer-freq has {len(pattern)} entries for {num_layers} layers")
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]
