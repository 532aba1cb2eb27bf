"""Tier: pure (torch only) for the stats; gloo ranks (2) for the cross-rank reduction."""

import pytest
import torch

from megatron_ext.moe.load_metrics import ExpertLoadMetrics, load_stats, peak_over_mean
from megatron_ext.testing import assert_no_host_sync, run_distributed
from tests.import_probe import imported_from


def test_hand_worked_example():
    # 3 tokens, top-2 over 4 experts on 2 EP ranks; token 2 is a pad.
    #   tokens per expert [3, 2, 1, 0] -> per rank [5, 1]; max 3, mean 1.5, max_vio 1.0
    #   real tokens       [2, 1, 1, 0] -> per rank [3, 1]; max 2, mean 1.0, max_vio 1.0
    routing_map_TE = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    metrics = ExpertLoadMetrics(num_experts=4, ep_size=2)
    metrics.record(3, routing_map_TE, torch.tensor([False, False, True]))
    s = metrics.summary()
    assert s["layer3/tokens"] == [3, 2, 1, 0] and s["layer3/real_tokens"] == [2, 1, 1, 0]
    assert s["layer3/rank_counts"] == [5.0, 1.0] and s["layer3/real_rank_counts"] == [3.0, 1.0]
    assert s["layer3/expert_max"] == 3 and s["layer3/expert_mean"] == 1.5
    assert s["layer3/expert_max_vio"] == 1.0 and s["layer3/real_expert_max_vio"] == 1.0
    assert s["layer3/rank_max_vio"] == pytest.approx((5 - 3) / 3)


def test_accumulates_and_resets_without_host_sync():
    g = torch.Generator().manual_seed(0)
    metrics = ExpertLoadMetrics(num_experts=8, ep_size=4)
    maps = [torch.rand(16, 8, generator=g) > 0.7 for _ in range(3)]
    pads = torch.arange(16) >= 12
    for m in maps:
        assert_no_host_sync(metrics.record, 1, m, pads)
        assert_no_host_sync(metrics.record, 2, m)
    stats = assert_no_host_sync(metrics.device_stats)
    assert torch.equal(stats["tokens_LE"][0], sum(m.sum(0) for m in maps))
    assert "real_tokens_LE" not in stats  # layer 2 had no pad mask
    vio = stats["expert_max_vio"][0]
    ref = stats["tokens_LE"][0].double()
    assert vio > 0 and torch.isclose(vio, (ref.max() - ref.mean()) / ref.mean())
    metrics.reset()
    assert metrics.layers == [] and metrics.summary() == {}


def test_empty_layer_is_balanced_and_bad_input_named():
    stats = load_stats(torch.zeros(2, 4, dtype=torch.long), ep_size=2)
    assert torch.equal(stats["expert_max_vio"], torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="layer 5"):
        ExpertLoadMetrics(num_experts=4).record(5, torch.zeros(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="EP ranks"):
        ExpertLoadMetrics(num_experts=6, ep_size=4)


def _reduce_across_ranks() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    metrics = ExpertLoadMetrics(num_experts=4, ep_size=2)
    routing = torch.zeros(2, 4, dtype=torch.bool)
    routing[:, rank] = True  # rank r sends both its tokens to expert r
    metrics.record(1, routing)
    return metrics.summary(group=dist.group.WORLD)


def test_summary_reduces_across_ranks():
    for s in run_distributed(_reduce_across_ranks, 2):
        assert s["layer1/tokens"] == [2, 2, 0, 0] and s["layer1/rank_counts"] == [4.0, 0.0]
        assert s["layer1/rank_max_vio"] == 1.0


def test_module_never_imports_megatron():
    assert imported_from(["megatron_ext.moe.load_metrics"], ["megatron"]) == []


def test_peak_over_mean_is_worst_layer_max_over_mean() -> None:
    # Layer 0 (the module docstring's example): experts [3 2 1 0] -> EP ranks [5 1]: 5/3 and 3/1.5.
    # Layer 1 is empty: balanced (1.0), never NaN, and not the worst.
    stats = load_stats(torch.tensor([[3, 2, 1, 0], [0, 0, 0, 0]]), ep_size=2)
    assert peak_over_mean(stats, "rank") == pytest.approx(5 / 3)
    assert peak_over_mean(stats, "expert") == pytest.approx(2.0)
    assert peak_over_mean(load_stats(torch.zeros(1, 4), ep_size=2), "rank") == 1.0
