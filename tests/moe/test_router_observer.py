"""Tier: Megatron on one rank. observe_routers counts a stock MoE model's routing, pads apart."""

import torch

from megatron_ext.testing import run_distributed


def _observe() -> dict:
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.moe.router_observer import observe_routers
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    model = build_tiny_gpt(tiny_moe_config())
    tokens = torch.randint(1, 128, (2, 16))
    pad_mask = torch.zeros(2, 16, dtype=torch.bool)
    pad_mask[:, 10:] = True
    tokens[pad_mask] = 0
    metrics = ExpertLoadMetrics(8, 1)
    with observe_routers(model, metrics):
        model(tokens, torch.arange(16).expand(2, 16), attention_mask=None, padding_mask=pad_mask)
    outside = ExpertLoadMetrics(8, 1)
    model(tokens, torch.arange(16).expand(2, 16), attention_mask=None)  # hooks are gone
    stats = metrics.device_stats()
    return {
        "layers": metrics.layers,
        "tokens": stats["tokens_LE"].sum(-1).tolist(),
        "real": stats["real_tokens_LE"].sum(-1).tolist(),
        "outside_layers": outside.layers,
        "after_exit": metrics.device_stats()["tokens_LE"].sum(-1).tolist(),
    }


def test_observer_counts_every_layer_with_pads_apart() -> None:
    r = run_distributed(_observe, 1)[0]
    assert r["layers"] == [1, 2]
    assert r["tokens"] == [2 * 16 * 2] * 2  # tokens x top-2, every layer
    assert r["real"] == [2 * 10 * 2] * 2  # the 6 pad positions per row are excluded
    assert r["after_exit"] == r["tokens"]  # leaving the block removed the hooks


def _no_router() -> str:
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.moe.router_observer import observe_routers
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    dense = build_tiny_gpt(tiny_moe_config(num_moe_experts=None))
    try:
        with observe_routers(dense, ExpertLoadMetrics(8, 1)):
            pass
    except ValueError as err:
        return str(err)
    return "no error"


def test_dense_model_is_refused() -> None:
    assert "no MoE layer" in run_distributed(_no_router, 1)[0]
