"""Tier: gloo ranks (real Megatron GPTModel on CPU). Record -> perturb -> replay round trips.

Each ``run_distributed`` call does several checks so the worker pool is spawned once per world:
record the routes a tiny MoE GPT chooses, perturb every router's weights (and assert the natural
routing changed), then replay and assert every MoE layer's routing map equals the recorded top-k
for 100 % of tokens, in the forward and in the recomputed forward of backward, at EP=1, EP=2 and
TP=2 with sequence parallelism; two micro-batches whose backwards run in reverse order check that
recompute is keyed, not FIFO.
"""

import torch

from megatron_ext.testing import run_distributed
from tests.replay.replay_model import (
    BATCH,
    SEQ,
    batch,
    build_model_for_seq,
    capture_maps,
    expected_maps,
    loss,
    record,
    routers,
    tiny_hybrid_model,
    tiny_replay_model,
)


def _round_trip(recompute: bool, hybrid: bool = False) -> dict:
    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.replay.routes import route_dtype

    torch.manual_seed(7)
    model = tiny_hybrid_model(recompute) if hybrid else tiny_replay_model(recompute)
    tokens_a, positions = batch(1)
    tokens_b, _ = batch(2)
    routes_a = record(model, tokens_a, positions)
    routes_b = record(model, tokens_b, positions)
    assert routes_a.dtype == torch.from_numpy(route_dtype(8, 2).type(0).reshape(1)).dtype
    assert routes_a.shape == (BATCH, SEQ, 2, 2)

    with torch.no_grad():  # perturb: the natural routing must change
        for router in routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 3.0)
    natural_a = record(model, tokens_a, positions)
    changed = (natural_a.sort(-1).values != routes_a.sort(-1).values).any(-1).float().mean()

    binding = RouteReplayBinding(model, "replay")
    log, handles = capture_maps(model)
    # Two micro-batches; backwards in reverse order (as pipeline schedules may interleave).
    binding.install(routes_a, key="a")
    loss_a = loss(model, tokens_a, positions)
    binding.install(routes_b, key="b")
    loss_b = loss(model, tokens_b, positions)
    loss_b.backward()
    loss_a.backward()
    for h in handles:
        h.remove()
    want_a, want_b = expected_maps(binding, routes_a), expected_maps(binding, routes_b)
    calls, exact = {}, True
    for number, maps in log.items():
        # Forward order a, b; with recompute the backward recomputes b, then a.
        expected = [want_a[number], want_b[number]]
        if recompute:
            expected += [want_b[number], want_a[number]]
        calls[number] = len(maps)
        exact &= len(maps) == len(expected) and all(
            torch.equal(got, want) for got, want in zip(maps, expected, strict=True)
        )
    grad_norm = sum(float(r.weight.grad.norm()) for r in routers(model))
    binding.remove()
    return {
        "changed": float(changed),
        "exact": exact,
        "calls": calls,
        "grad": grad_norm,
        "layers": sorted(log),
    }


def _native_rows_and_errors() -> dict:
    """Missing rows take the router's own choice; bad installs raise clear errors."""
    from megatron_ext.replay.binding import RouteReplayBinding

    torch.manual_seed(7)
    model = tiny_replay_model(False)
    tokens, positions = batch(3)
    natural = record(model, tokens, positions)
    routes = torch.flip(natural, dims=[-1]).clone()
    routes[:, 0::2] = (natural[:, 0::2] + 1) % 8  # replayed (even) positions differ from natural
    routes[:, 1::2] = 255  # odd positions missing -> native; every SP/CP shard holds both kinds
    binding = RouteReplayBinding(model, "replay", missing_route_policy="native")
    log, handles = capture_maps(model)
    binding.install(routes, key=0)
    loss(model, tokens, positions).backward()
    for h in handles:
        h.remove()
    mixed = natural.clone()
    mixed[:, 0::2] = routes[:, 0::2]
    want = expected_maps(binding, mixed)
    rows_replayed = _replayed_rows(binding)
    first = min(want)
    # Native rows equal natural routing at the first MoE layer (later layers see hidden states
    # changed by the replayed rows); replayed rows are exact everywhere; K experts everywhere.
    native_ok = torch.equal(log[first][0], want[first]) and all(
        torch.equal(log[n][0][rows_replayed], want[n][rows_replayed])
        and bool((log[n][0].sum(-1) == 2).all())
        for n in want
    )
    native_ok &= not torch.equal(
        log[first][0][rows_replayed], expected_maps(binding, natural)[first][rows_replayed]
    )  # non-vacuous: the replayed rows are not the natural routing
    native_ok &= bool(rows_replayed.any()) and not bool(rows_replayed.all())
    errors = []
    for bad in (routes[..., :1, :], routes[..., :1]):
        try:
            binding.install(bad, key=1)
        except ValueError as exc:
            errors.append(str(exc))
    syncs = _host_syncs_of_replay(binding, routes)
    binding.remove()
    for field in ("moe_router_fusion", "moe_expert_capacity_factor"):
        config = model.config
        original = getattr(config, field)
        setattr(config, field, True if field == "moe_router_fusion" else 1.0)
        try:
            RouteReplayBinding(model, "replay")
        except ValueError as exc:
            errors.append(str(exc))
        finally:
            setattr(config, field, original)
    return {"native_ok": native_ok, "errors": errors, "syncs": syncs}


def _host_syncs_of_replay(binding, routes_BSLK) -> list[str]:
    """install() and one router's replay (with native missing rows) must not sync."""
    from megatron_ext.testing import count_host_syncs

    def replay_once():
        binding.install(routes_BSLK, key="sync-check")
        scores = torch.randn(binding._my_positions(BATCH, SEQ).numel(), 8)
        return binding.route(
            binding.replays[0],
            scores,
            2,
            None,
            None,
            lambda s, k, g=None, gk=None: torch.topk(s, k, dim=1),
        )

    (probs, idx), syncs = count_host_syncs(replay_once)
    assert probs.shape[1] == 2 and idx.dtype == torch.int64
    return syncs


def _replayed_rows(binding) -> torch.Tensor:
    """Router rows on this rank that hold an even sequence position (the replayed ones)."""
    positions = binding._my_positions(BATCH, SEQ)
    return positions % 2 == 0


def _zigzag_matches_megatron() -> bool:
    """Our CP slicing equals Megatron's get_batch_on_this_cp_rank on the real CP group."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_ext.common.token_positions import router_row_positions
    from megatron_ext.replay.layout import rows_for_router

    routes = torch.randint(0, 8, (BATCH, SEQ, 2, 2), dtype=torch.uint8)
    theirs = get_batch_on_this_cp_rank(
        {"routes": routes, "cu_seqlens": None},
        False,
        cp_group=parallel_state.get_context_parallel_group(),
    )
    positions = router_row_positions(
        BATCH, SEQ, cp_size=2, cp_rank=parallel_state.get_context_parallel_rank()
    )
    ours = rows_for_router(routes, positions)
    return torch.equal(ours, theirs["routes"].transpose(0, 1).reshape(-1, 2, 2))


def _all_checks() -> dict:
    return {
        "plain": _round_trip(False),
        "recompute": _round_trip(True),
        **_native_rows_and_errors(),
    }


def _assert_round_trip(result: dict, names=("plain", "recompute")) -> None:
    for name in names:
        r = result[name]
        assert r["changed"] > 0.3, r  # the perturbation changed natural routing
        assert r["exact"], r
        assert r["grad"] > 0, r  # replayed probs still train the router
    for name in names:  # 2 micro-batches: forward only, or forward + recompute
        assert all(n == (4 if "recompute" in name else 2) for n in result[name]["calls"].values())


def test_round_trip_ep1_single_rank():
    (result,) = run_distributed(_all_checks, 1)
    _assert_round_trip(result)
    assert result["native_ok"]
    assert "MoE layers" in result["errors"][0] and "--moe-router-topk" in result["errors"][1]
    assert "--moe-router-fusion" in result["errors"][2]
    assert "--moe-expert-capacity-factor" in result["errors"][3]
    assert result["syncs"] == []


def test_round_trip_ep2():
    for result in run_distributed(_all_checks, 2, ep=2):
        _assert_round_trip(result)
        assert result["native_ok"] and result["syncs"] == []


def test_round_trip_tp2_sequence_parallel():
    results = run_distributed(_all_checks, 2, tp=2, sp=True)
    for result in results:
        _assert_round_trip(result)
        assert result["native_ok"] and result["syncs"] == []


def test_zigzag_cp_layout_matches_megatron():
    assert all(run_distributed(_zigzag_matches_megatron, 2, cp=2))


def _per_document_cp_rows() -> dict:
    """A packed THD row under CP=2: install slices the routes by the index the forward step split
    the batch with; record puts each CP rank's rows back by the per-document split."""
    from megatron.core import parallel_state

    from megatron_ext.common.thd_partition import thd_partitioned_indices
    from megatron_ext.replay.binding import RouteReplayBinding

    rank = parallel_state.get_context_parallel_rank()
    cu = torch.tensor([0, 8, 12, 12, 16, 24, 32], dtype=torch.int32)  # an empty segment too
    routes = torch.randint(0, 8, (1, 32, 2, 2), dtype=torch.uint8, generator=torch.Generator())
    index = thd_partitioned_indices(cu, 32, 2, rank)
    model = tiny_replay_model(False)
    binding = RouteReplayBinding(model, "replay")
    binding.install(routes, key="k", cp_index=index)
    rows_LNK = binding._targets["k"][0]
    installed = torch.equal(rows_LNK, routes[0, index.long()].transpose(0, 1))
    binding.remove()
    binding = RouteReplayBinding(model, "record")
    binding.begin_record("k", 1, 32, cu_seqlens=cu)
    for ordinal in binding.stage_ordinals:  # what each router would have recorded on this rank
        binding._recorded[("k", ordinal)] = routes[0, index.long(), ordinal].long()
    recorded = binding.recorded_routes("k")
    binding.remove()
    return {"installed": installed, "recorded": torch.equal(recorded, routes)}


def test_a_packed_row_is_sliced_and_gathered_per_document_under_cp():
    results = run_distributed(_per_document_cp_rows, 2, cp=2)
    assert all(r["installed"] and r["recorded"] for r in results), results


def _cp_index_worker() -> dict:
    """RouteReplay (replay in your own loop) under CP 2: the positions set_routes keeps of a packed row are Megatron's per-document
    split of the tokens (TE's thd_get_partitioned_indices, stood in on CPU)."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_ext.common.thd_partition import thd_partitioned_indices
    from megatron_ext.replay.route_replay import RouteReplay

    replay = SimpleNamespace(cp_size=parallel_state.get_context_parallel_world_size())
    cu = torch.tensor([0, 4, 8, 16], dtype=torch.int32)
    rank = parallel_state.get_context_parallel_rank()
    got = RouteReplay._cp_index(replay, 16, True, cu)
    errors = []
    for thd, bounds in ((True, None), (False, cu)):
        try:
            RouteReplay._cp_index(replay, 16, thd, bounds)
        except ValueError as err:
            errors.append(str(err))
    return {
        "cp": replay.cp_size,
        "equal": torch.equal(got.long(), thd_partitioned_indices(cu, 16, 2, rank).long()),
        "positions": got.tolist(),
        "zigzag_left_to_binding": RouteReplay._cp_index(replay, 16, False, None) is None,
        "errors": errors,
    }


def test_set_routes_under_context_parallelism_takes_megatrons_per_document_split() -> None:
    results = run_distributed(_cp_index_worker, 2, cp=2)
    assert all(r["cp"] == 2 and r["equal"] and r["zigzag_left_to_binding"] for r in results)
    # The two ranks hold complementary halves of every document (a real split occurred).
    assert sorted(results[0]["positions"] + results[1]["positions"]) == list(range(16))
    assert results[0]["positions"] == [0, 3, 4, 7, 8, 9, 14, 15]
    for r in results:
        assert "needs the row's 1-D cu_seqlens" in r["errors"][0]
        assert "cu_seqlens is for packed" in r["errors"][1]


def _thd_flattened_batch() -> dict:
    """THD: a [B, S] batch flattened to one row [1, B*S]. Router rows then run b*S+s, so routes
    reshaped to [1, B*S, L, K] replay exactly and recorded_routes returns that layout."""
    from megatron.core import parallel_state

    from megatron_ext.replay.binding import RouteReplayBinding

    torch.manual_seed(7)
    model = build_model_for_seq(BATCH * SEQ)
    tokens, _ = batch(4)
    tokens_thd = tokens.reshape(1, BATCH * SEQ)
    positions_thd = torch.arange(SEQ).repeat(BATCH).unsqueeze(0)  # restart per sample
    # This rank's router rows: the whole flat row, or its TP slice under SP.
    tp = (
        parallel_state.get_tensor_model_parallel_world_size()
        if model.config.sequence_parallel
        else 1
    )
    local = BATCH * SEQ // tp
    offset = parallel_state.get_tensor_model_parallel_rank() * local if tp > 1 else 0

    def naive_maps(routes_XLK):  # router row j holds flat token offset + j
        rows = routes_XLK[offset : offset + local].long()
        eye = torch.eye(8, dtype=torch.bool)
        return {n: eye[rows[:, i]].any(1) for i, n in enumerate(sorted(log))}

    record = RouteReplayBinding(model, "record")
    log, handles = capture_maps(model)
    record.begin_record(0, 1, BATCH * SEQ)
    loss(model, tokens_thd, positions_thd).backward()
    recorded = record.recorded_routes(0)
    record.remove()
    recorded_ok = recorded.shape == (1, BATCH * SEQ, 2, 2) and all(
        torch.equal(log[n][0], want) for n, want in naive_maps(recorded[0]).items()
    )
    for h in handles:
        h.remove()

    routes_BSLK = torch.flip(recorded.reshape(BATCH, SEQ, 2, 2), dims=[0]).contiguous()
    results = {}
    binding = RouteReplayBinding(model, "replay")
    log, handles = capture_maps(model)
    binding.install(routes_BSLK.reshape(1, BATCH * SEQ, 2, 2), key="thd")  # the documented layout
    loss(model, tokens_thd, positions_thd).backward()
    for h in handles:
        h.remove()
    want = naive_maps(routes_BSLK.reshape(BATCH * SEQ, 2, 2))
    results["thd"] = all(torch.equal(log[n][0], want[n]) for n in want)
    # [B, S, L, K] under a THD forward: the row counts agree, but rows would be taken in s*B+b
    # order (each token replaying another's route). Refused at the decoder, naming the reshape.
    binding.install(routes_BSLK, key="bshd")
    try:
        loss(model, tokens_thd, positions_thd)
        results["bshd"] = "ran"
    except ValueError as err:
        results["bshd"] = str(err)
    binding.remove()
    # Non-vacuous: the replayed routes are not the recorded (natural) ones.
    moved = not torch.equal(routes_BSLK.reshape(1, BATCH * SEQ, 2, 2), recorded)
    return {"recorded_ok": recorded_ok, "moved": moved, **results}


def _hybrid_and_thd_checks(hybrid: bool) -> dict:
    result = {"thd": _thd_flattened_batch()}
    if hybrid:
        result["hybrid_recompute"] = _round_trip(True, hybrid=True)
    return result


def _assert_thd(thd: dict) -> None:
    assert thd["recorded_ok"] and thd["moved"] and thd["thd"], thd
    assert "pass routes_BSLK.reshape(1, B * S, L, K)" in thd["bshd"], thd  # refused, not replayed


def test_hybrid_model_and_thd_layout_replay_exactly():
    (result,) = run_distributed(_hybrid_and_thd_checks, 1, True)
    _assert_round_trip(result, names=("hybrid_recompute",))
    assert result["hybrid_recompute"]["layers"] == [2, 4]  # "*E*E": routers on layers 2 and 4
    _assert_thd(result["thd"])


def test_thd_layout_replays_exactly_tp2_sequence_parallel():
    # The local hybrid stack spec has no SP-capable norm: GPTModel only here.
    for result in run_distributed(_hybrid_and_thd_checks, 2, False, tp=2, sp=True):
        _assert_thd(result["thd"])


def _a_forward_nobody_installed() -> dict:
    """A second forward on the same install (replay) or begin_record (record): it would replay
    the previous micro-batch's routes, or record over them, so it is refused. A recompute of the
    installed micro-batch (its backward) and the next install both still work."""
    from megatron_ext.replay.binding import RouteReplayBinding

    torch.manual_seed(7)
    model = tiny_replay_model(True)  # activation recompute: routers run again in the backward
    tokens_a, positions = batch(1)
    tokens_b, _ = batch(2)
    routes_a = record(model, tokens_a, positions)
    out = {}
    for mode in ("replay", "record"):
        binding = RouteReplayBinding(model, mode)
        if mode == "replay":
            binding.install(routes_a, key="a")
        else:
            binding.begin_record("a", BATCH, SEQ)
        loss(model, tokens_a, positions).backward()  # forward + recompute in the backward: fine
        try:
            loss(model, tokens_b, positions)
            out[mode] = "ran"
        except RuntimeError as err:
            out[mode] = str(err)
        if mode == "replay":
            binding.install(routes_a, key="b")  # announced: runs
        else:
            binding.begin_record("b", BATCH, SEQ)
        loss(model, tokens_b, positions).backward()
        out[f"{mode} next"] = "ran"
        binding.remove()
    return out


def test_a_forward_without_install_does_not_reuse_the_last_routes():
    out = run_distributed(_a_forward_nobody_installed, 1)[0]
    for mode in ("replay", "record"):
        assert "a second time: call RouteReplayBinding.install()/begin_record()" in out[mode], out
        assert out[f"{mode} next"] == "ran"
