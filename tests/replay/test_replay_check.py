"""Tier: pure tensors, then real Megatron GPTModel on one gloo rank. ``ReplayCheck`` counts, per
training micro-batch once, the rows with a recorded route (and those used exactly), the rows
without one (and those routed as the policy decided), and where the router's own top-k differs."""

import pytest
import torch

from megatron_ext.replay.replay_check import ReplayCheck, ReplayCounts, _same_sets
from megatron_ext.testing import run_distributed
from tests.replay.replay_model import BATCH, SEQ


def test_same_sets_is_order_free():
    a = torch.tensor([[0, 3], [1, 2], [4, 5]])
    b = torch.tensor([[3, 0], [1, 3], [5, 4]])
    assert _same_sets(a, b, 8).tolist() == [True, False, True]


def _routing_map(idx_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(idx_NK.shape[0], num_experts, dtype=torch.bool).scatter_(1, idx_NK, True)


def _fields(counts: ReplayCounts) -> tuple[int, ...]:
    return tuple(getattr(counts, f) for f in ReplayCheck.FIELDS)


def test_counts_recorded_and_missing_rows_apart():
    # 5 rows: 0, 1, 3 and 4 recorded, 2 missing (decided by the policy: idx holds its decision).
    # Used: row 2 as decided; row 3 ignores the replay (4, 6); row 4 gets an extra expert.
    # Natural (router's own) sets differ from the decided ones on rows 1, 2 and 4; row 2 is
    # missing, so only 1 and 4 count: (recorded 4, exact 2, missing 1, as decided 1, differs 2).
    check = ReplayCheck("native")
    decided = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 2]])
    natural = torch.tensor([[1, 0], [2, 5], [4, 6], [6, 7], [0, 3]])
    missing = torch.tensor([False, False, True, False, False])
    check.count("a")
    check._observe("a", torch.rand(5, 8), decided, missing, lambda: natural)
    used = decided.clone()
    used[3] = torch.tensor([4, 6])
    routing_map = _routing_map(used, 8)
    routing_map[4, 7] = True
    check._compare(None, (), {}, (None, routing_map))
    counts = check.take()
    assert _fields(counts) == (4, 2, 1, 1, 2)
    assert _fields(check.take()) == (0, 0, 0, 0, 0)  # take() resets
    assert [p.split(":")[0] for p in counts.problems()] == ["ERROR"]
    assert (
        "2 of 4 (token, layer) rows with a recorded route were NOT routed" in counts.problems()[0]
    )


def test_no_missing_mask_means_every_row_recorded():
    check = ReplayCheck("native")
    decided = torch.tensor([[0, 1], [2, 3]])
    check.count(7)
    check._observe(7, torch.rand(2, 4), decided, None, lambda: decided)
    check._compare(None, (), {}, (None, _routing_map(decided, 4)))
    counts = check.take()
    assert _fields(counts) == (2, 2, 0, 0, 0) and counts.problems() == []


def test_skipped_pads_are_not_replayed_rows():
    """``--moe-pad-routing skip``: the MoE layer clears a pad's route after routing, so the pad
    reaches no expert. 4 rows, 2 and 3 pads (3 missing, as a constant pad is); all routed as
    decided, natural differs on rows 0 and 2: counted are rows 0 and 1 only (2, 2, 0, 0, 1). With
    pads routed (dispatch) every row counts: (3, 3, 1, 1, 2)."""
    decided = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    natural = torch.tensor([[0, 2], [3, 2], [4, 7], [6, 7]])
    missing = torch.tensor([False, False, False, True])
    pad_SB = torch.tensor([[False, False, True, True]]).T  # Megatron's [S, B] padding mask
    got = {}
    for skipped in (True, False):
        check = ReplayCheck("native", pads_skipped=skipped)
        check.count("a")
        check._observe("a", torch.rand(4, 8), decided, missing, lambda: natural)
        check._compare(None, (torch.rand(4, 1, 8), pad_SB), {}, (None, _routing_map(decided, 8)))
        got[skipped] = _fields(check.take())
    assert got == {True: (2, 2, 0, 0, 1), False: (3, 3, 1, 1, 2)}


def test_only_the_counted_micro_batch_and_its_first_routing_count():
    """Evaluation forwards (count(None)), another key, and a router call without an observed
    routing (a recompute in backward: the binding does not report it) add nothing."""
    check = ReplayCheck("native")
    decided = torch.tensor([[0, 1]])
    routing = (None, _routing_map(decided, 4))
    for counted, key in ((None, ("eval", 1)), ((3, 0), (3, 1))):
        check.count(counted)
        check._observe(key, torch.rand(1, 4), decided, None, lambda: decided)
        check._compare(None, (), {}, routing)
    check._compare(None, (), {}, routing)  # a recompute
    assert _fields(check.take()) == (0, 0, 0, 0, 0)
    check.count((3, 1))
    with torch.no_grad():  # a checkpointed forward runs without grad: counted
        check._observe((3, 1), torch.rand(1, 4), decided, None, lambda: decided)
        check._compare(None, (), {}, routing)
    check._compare(None, (), {}, routing)  # its recompute
    assert _fields(check.take()) == (1, 1, 0, 0, 0)


def test_nothing_replayed_is_said_so():
    counts = ReplayCounts(
        recorded=0, recorded_exact=0, missing=96, missing_as_decided=96, natural_differs=0,
        policy="native",
    )  # fmt: skip
    assert counts.line().startswith("0 (token, layer) rows with a recorded route, 0 used exactly;")
    assert "96 without one, 96 routed by the model's own router (native)" in counts.line()
    (problem,) = counts.problems()
    assert problem.startswith("WARNING: no row of this interval had a recorded route")
    balanced = ReplayCounts(
        recorded=4, recorded_exact=4, missing=2, missing_as_decided=1, natural_differs=1,
        policy="balanced",
    )  # fmt: skip
    assert "2 without one, 1 filled with a balanced top-k (balanced)" in balanced.line()
    assert balanced.problems() == [
        "ERROR: 1 of 2 rows without a recorded route were not routed as "
        "--replay-missing-route-policy balanced decided"
    ]
    assert balanced.record()["natural_differs"] == 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="--replay-missing-route-policy"):
        ReplayCheck("nearest")


# ------------------------------------------------------------------------------------------------
# In a real model: the binding reports each forward routing, recompute or not
# ------------------------------------------------------------------------------------------------


def _checked_replay(recompute: bool, policy: str) -> dict:
    """Two micro-batches replayed with the check attached: routes recorded from the model, odd
    sequence positions missing (native) or filled by the data (balanced, with its mask); a third,
    evaluation-like forward under no_grad that is not counted."""
    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.testing import count_host_syncs
    from tests.replay.replay_model import batch, loss, record, tiny_replay_model

    torch.manual_seed(7)
    model = tiny_replay_model(recompute)
    tokens, positions = batch(3)
    routes = record(model, tokens, positions)
    routes = torch.flip(routes, dims=[-1]).clone()
    routes[:, 0::2] = (routes[:, 0::2] + 1) % 8  # not what the router would choose
    filled = torch.zeros(routes.shape[:3], dtype=torch.bool)
    filled[:, 1::2] = True
    routes[:, 1::2] = 255 if policy == "native" else torch.tensor([3, 5], dtype=torch.uint8)
    binding = RouteReplayBinding(model, "replay", missing_route_policy=policy)
    check = ReplayCheck(policy)
    check.attach(binding)
    mask = filled if policy == "balanced" else None
    for key in ("a", "b"):
        check.count(key)
        binding.install(routes, key=key, filled_BSL=mask)
        loss(model, tokens, positions).backward()
    check.count(None)
    binding.install(routes, key=("eval", 0), filled_BSL=mask)
    with torch.no_grad():
        loss(model, tokens, positions)
    counts = check.take()

    def checked_routing() -> None:  # install, one router's replay and the check's comparison
        check.count("sync")
        binding.install(routes, key="sync", filled_BSL=mask)
        scores = torch.randn(BATCH * SEQ, binding.config.num_moe_experts)
        probs, idx = binding.route(
            binding.replays[0], scores, 2, None, None, lambda s, k, *_: torch.topk(s, k, dim=1)
        )
        used = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        check._compare(None, (), {}, (probs, used))

    _, syncs = count_host_syncs(checked_routing)
    observed = _fields(check.take())
    binding.remove()
    layers = len(binding.replays)
    return {
        "counts": _fields(counts),
        "want": (2 * BATCH * SEQ // 2 * layers,) * 4,
        "syncs": syncs,
        "sync_check_counted": observed[0] + observed[2],
    }


def _all_checked_replays() -> dict:
    return {
        (recompute, policy): _checked_replay(recompute, policy)
        for recompute in (False, True)
        for policy in ("native", "balanced")
    }


def test_counts_are_those_of_the_data_with_and_without_recompute():
    (results,) = run_distributed(_all_checked_replays, 1)
    for (recompute, policy), r in results.items():
        recorded, exact, missing, decided, differs = r["counts"]
        # Half the rows recorded, half missing, per micro-batch and layer; all used as decided.
        assert (recorded, exact, missing, decided) == r["want"], (recompute, policy, r)
        assert 0 < differs <= recorded, (recompute, policy, r)  # routes the router would not pick
        assert r["syncs"] == [], r["syncs"]  # no device-to-host sync in the checked routing
        assert r["sync_check_counted"] == BATCH * SEQ, r  # ... which did count (not vacuous)
    for policy in ("native", "balanced"):  # recompute changes no count
        assert results[(False, policy)]["counts"] == results[(True, policy)]["counts"]
