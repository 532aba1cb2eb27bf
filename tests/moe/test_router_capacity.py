"""Tier: Megatron on one rank (no process group needed for the router math). Under a capacity factor
pads are dropped before real tokens: ``PaddedTopKRouter`` keeps Megatron's own choice among the real
tokens and gives pads only the slots they left free, under both of Megatron's drop policies.

Hand-worked case (8 tokens, 2 experts, top-1, capacity factor 0.5 -> capacity ceil(8/2*0.5) = 2):
tokens 0-3 are real, 4-7 pads, all routed to expert 0, the pads with the higher probabilities::

    Megatron ("probs"):  keeps the two most probable: two pads; every real token is dropped
    ours:                keeps two real tokens (Megatron's choice among them); pads get no slot
"""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

from megatron_ext.moe.pad_routing import pads_first_keep


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = torch.tensor([0.6, 0.55, 0.52, 0.51, 0.9, 0.8, 0.7, 0.65])
    probs_TE = torch.stack([probs, torch.zeros(8)], dim=1)
    routing_map_TE = probs_TE > 0
    pad_T = torch.tensor([False] * 4 + [True] * 4)
    return probs_TE, routing_map_TE, pad_T


def _ours(probs_TE, routing_map_TE, pad_T, policy: str, capacity_factor: float = 0.5):
    """What PaddedTopKRouter._drop_pads_first computes, on the router's math alone."""
    pad_T1 = pad_T[:, None]
    _, kept_TE = apply_router_token_dropping(
        probs_TE.masked_fill(pad_T1, 0.0),
        routing_map_TE & ~pad_T1,
        router_topk=1,
        capacity_factor=capacity_factor,
        drop_policy=policy,
    )
    capacity = 2 if capacity_factor == 0.5 else 4
    return kept_TE | pads_first_keep(kept_TE, routing_map_TE, probs_TE, pad_T, capacity, policy)


def test_megatron_drops_real_tokens_while_pads_hold_slots_and_ours_does_not() -> None:
    probs_TE, routing_map_TE, pad_T = _case()
    _, megatron_TE = apply_router_token_dropping(
        probs_TE, routing_map_TE, router_topk=1, capacity_factor=0.5, drop_policy="probs"
    )
    assert megatron_TE[:, 0].tolist() == [False] * 4 + [True, True, False, False]  # the bug
    ours_TE = _ours(probs_TE, routing_map_TE, pad_T, "probs")
    assert ours_TE[:, 0].tolist() == [True, True] + [False] * 6  # the two most probable real ones
    assert not ours_TE[:, 1].any()


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pads_take_only_the_slots_real_tokens_leave(policy: str) -> None:
    probs_TE, routing_map_TE, pad_T = _case()
    # Capacity 4 (factor 1.0): all four real tokens fit, then no slot is left for a pad.
    ours_TE = _ours(probs_TE, routing_map_TE, pad_T, policy, capacity_factor=1.0)
    assert ours_TE[:, 0].tolist() == [True] * 4 + [False] * 4
    # Two real tokens only: two slots free for pads, the most probable (or earliest) pads take them.
    two_real = pad_T.clone()
    two_real[2:4] = True
    kept = _ours(probs_TE, routing_map_TE, two_real, policy, capacity_factor=1.0)
    pads_kept = [i for i in range(8) if kept[i, 0] and two_real[i]]
    assert kept[:2, 0].all() and len(pads_kept) == 2
    assert pads_kept == ([4, 5] if policy == "probs" else [2, 3])


def _router_checks(policy: str) -> dict:
    """Megatron's TopKRouter beside PaddedTopKRouter (same weights) under a capacity factor."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.moe.router import PaddedTopKRouter
    from megatron_ext.testing import count_host_syncs, tiny_moe_config

    kwargs = dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    cfg = tiny_moe_config(**kwargs)
    # Expert bias (its counts must be taken after dropping); Megatron's own count fails on the mask.
    bias_cfg = tiny_moe_config(
        **kwargs,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    pgs = get_default_pg_collection()
    stock, ours = TopKRouter(config=cfg, pg_collection=pgs), PaddedTopKRouter(cfg, pgs)
    biased = PaddedTopKRouter(bias_cfg, pgs)
    for router in (stock, ours, biased):
        router.set_layer_number(1)
    ours.load_state_dict(stock.state_dict())
    biased.load_state_dict(stock.state_dict(), strict=False)
    S, B = 16, 2
    gen = torch.Generator().manual_seed(0)
    x_SBH = torch.randn(S, B, cfg.hidden_size, generator=gen)
    # Pads (the last 10 positions of each row) all aim at experts 0 and 1 with high probability.
    pad_BS = torch.zeros(B, S, dtype=torch.bool)
    pad_BS[:, 6:] = True
    x_SBH[pad_BS.t()] = 50.0 * stock.weight.detach()[:2].sum(0)
    res: dict = {"config_factor": ours.config.moe_expert_capacity_factor, "policy": policy}
    no_pads = torch.zeros_like(pad_BS)
    (p_stock, m_stock), (p_ours, m_ours) = stock(x_SBH, no_pads.t()), ours(x_SBH, no_pads.t())
    res["no_pads_bitwise"] = torch.equal(p_stock, p_ours) and torch.equal(m_stock, m_ours)
    pad_SB = pad_BS.t()  # the MoE layer hands the router [S, B] (its token order, s-major)
    rows = pad_SB.reshape(-1)
    _, m_stock = stock(x_SBH, pad_SB)
    (p_ours, m_ours), syncs = count_host_syncs(ours, x_SBH, pad_SB)
    _, stock_syncs = count_host_syncs(stock, x_SBH, pad_SB)
    before = torch.zeros(rows.numel(), cfg.num_moe_experts, dtype=torch.bool)
    with torch.no_grad():  # every token's routes before dropping: capacity above all tokens
        ours.capacity_factor, stock_factor = 100.0, ours.capacity_factor
        _, before = ours(x_SBH, pad_SB)
        ours.capacity_factor = stock_factor

    def real_dropped_while_pad_kept(kept: torch.Tensor) -> list[int]:
        dropped_real = (before & ~kept & ~rows[:, None]).any(0)
        kept_pad = (kept & rows[:, None]).any(0)
        return [e for e in range(cfg.num_moe_experts) if dropped_real[e] and kept_pad[e]]

    res["megatron_conflicts"] = real_dropped_while_pad_kept(m_stock)
    res["our_conflicts"] = real_dropped_while_pad_kept(m_ours)
    res["our_real_kept"] = int((m_ours & ~rows[:, None]).sum())
    res["megatron_real_kept"] = int((m_stock & ~rows[:, None]).sum())
    res["probs_zero_where_dropped"] = bool((p_ours[~m_ours] == 0).all())
    res["new_syncs"] = len(syncs) - len(stock_syncs)
    # Six real tokens (the first 3 positions of each row) also aim at expert 2, past its capacity
    # of 4: real routes are dropped too, so counts taken before dropping would differ.
    x_bias = x_SBH.clone()
    x_bias[:3] = 50.0 * stock.weight.detach()[2]
    with torch.no_grad():  # no count: the bias gate needs grad enabled
        biased.capacity_factor, bias_factor = 100.0, biased.capacity_factor
        _, before_biased = biased(x_bias, pad_SB)
        biased.capacity_factor = bias_factor
    x_bias.requires_grad_(True)  # expert-bias counts are taken in training forwards (grad enabled)
    _, m_biased = biased(x_bias, pad_SB)
    real = ~rows[:, None]
    res["bias_counts"] = biased.local_tokens_per_expert.tolist()
    res["bias_expected"] = (m_biased & real).sum(0).float().tolist()
    res["bias_before_drop"] = (before_biased & real).sum(0).float().tolist()
    res["bias_dropped_real"] = int((before_biased & ~m_biased & real).sum())
    return res


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_megatron_router_with_capacity_drops_pads_first(policy: str) -> None:
    from megatron_ext.testing import run_distributed

    (r,) = run_distributed(_router_checks, 1, policy)
    assert r["config_factor"] is None  # Megatron's own dropping is switched off in the copy
    assert r["no_pads_bitwise"], r  # no pads: exactly Megatron's dropping
    assert r["bias_dropped_real"] > 0, r  # the case where the counts' timing matters occurred
    assert r["bias_counts"] == r["bias_expected"] != r["bias_before_drop"], r
    assert r["megatron_conflicts"], (
        r
    )  # the bug occurs: a real token dropped while a pad holds a slot
    assert r["our_conflicts"] == [], r
    assert r["our_real_kept"] > r["megatron_real_kept"], r
    assert r["probs_zero_where_dropped"] and r["new_syncs"] <= 0, r
