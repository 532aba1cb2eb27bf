"""Tier: pure tensors. ``ReplayCheck`` counts rows whose routing map holds exactly the replayed experts."""

import torch

from megatron_ext.replay.replay_check import ReplayCheck, _same_sets


def test_same_sets_is_order_free():
    a = torch.tensor([[0, 3], [1, 2], [4, 5]])
    b = torch.tensor([[3, 0], [1, 3], [5, 4]])
    assert _same_sets(a, b, 8).tolist() == [True, False, True]


def _routing_map(idx_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(idx_NK.shape[0], num_experts, dtype=torch.bool).scatter_(1, idx_NK, True)


def test_counts_matches_misses_and_natural_differences():
    check = ReplayCheck()
    replayed = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    natural = torch.tensor([[1, 0], [2, 5], [4, 5], [0, 7]])  # rows 1 and 3 differ as sets
    scores = torch.rand(4, 8)
    check._observe(0, scores, replayed, lambda: natural)
    used = replayed.clone()
    used[2] = torch.tensor([4, 6])  # the router ignored the replay on row 2
    routing_map = _routing_map(used, 8)
    routing_map[3, 0] = True  # and routed row 3 to an extra expert
    check._compare(None, None, (None, routing_map))
    assert check.take() == (4, 2, 2)
    assert check.take() == (0, 0, 0)  # take() resets


def test_no_grad_forwards_are_not_counted():
    check = ReplayCheck()
    replayed = torch.tensor([[0, 1]])
    check._observe(0, torch.rand(1, 4), replayed, lambda: replayed)
    with torch.no_grad():
        check._compare(None, None, (None, _routing_map(replayed, 4)))
    assert check.take()[0] == 0
