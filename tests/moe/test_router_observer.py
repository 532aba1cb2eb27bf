"""Tier: Megatron on one rank. observe_routers counts a stock MoE model's routing, pads apart."""

import torch

from megatron_ext.testing import run_distributed


def _observe() -> dict:
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.moe.router_observer import observe_routers
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    model = build_tiny_gpt(tiny_moe_config())
    tokens = torch.randint(1, 128, (2, 16))
    pad_mask = torch.zeros(2, 16, dtype=torch.bool)
    pad_mask[0, 10:] = True  # rows padded differently: a mask read in the wrong order miscounts
    pad_mask[1, 3:] = True
    tokens[pad_mask] = 0
    # The routers' own outputs, kept independently of the observer: Megatron routes the tokens
    # sequence-major ([S, B] flattened), so the pad of router row s * B + b is pad_mask[b, s].
    maps = []
    hooks = [
        m.register_forward_hook(lambda mod, i, out: maps.append(out[1].detach()))
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    metrics = ExpertLoadMetrics(8, 1)
    with observe_routers(model, metrics):
        model(tokens, torch.arange(16).expand(2, 16), attention_mask=None, padding_mask=pad_mask)
    for h in hooks:
        h.remove()
    real_T = ~pad_mask.T.reshape(-1)
    stats = metrics.device_stats()
    before_exit = stats["tokens_LE"].clone()
    model(tokens, torch.arange(16).expand(2, 16), attention_mask=None)  # hooks are gone
    return {
        "layers": metrics.layers,
        "tokens_LE": stats["tokens_LE"].tolist(),
        "real_LE": stats["real_tokens_LE"].tolist(),
        "expected_tokens_LE": [m.sum(0).tolist() for m in maps],
        "expected_real_LE": [m[real_T].sum(0).tolist() for m in maps],
        "unchanged_after_exit": torch.equal(metrics.device_stats()["tokens_LE"], before_exit),
    }


def test_observer_counts_every_layer_with_pads_apart() -> None:
    r = run_distributed(_observe, 1)[0]
    assert r["layers"] == [1, 2]
    assert r["tokens_LE"] == r["expected_tokens_LE"]
    assert [sum(e) for e in r["tokens_LE"]] == [2 * 16 * 2] * 2  # tokens x top-2, every layer
    # Per expert, not only in total: only the pads' own rows are left out.
    assert r["real_LE"] == r["expected_real_LE"]
    assert [sum(e) for e in r["real_LE"]] == [(10 + 3) * 2] * 2
    assert r["real_LE"] != r["tokens_LE"]  # some expert got pads: the split was exercised
    assert r["unchanged_after_exit"]  # leaving the block removed the hooks


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
