"""Tests for megatron_ext.replay.RouteReplay (route replay in the caller's own loop).

Tier: gloo ranks (real Megatron GPTModel on CPU) for the API, and subprocesses for
examples/replay_in_your_loop.py (2 gloo ranks, its own loop, no ``pretrain``): routes of an
ingested vLLM dump replayed exactly in every router call (forward and the recompute of backward),
and the trainer/engine log-prob mismatch smaller with replay than without.
"""

import json
from pathlib import Path

import numpy as np
import torch

from megatron_ext.testing import run_distributed
from megatron_ext.testing.real_loop import launch
from tests.replay.replay_model import BATCH, SEQ, batch, capture_maps, record, routers

ROOT = Path(__file__).resolve().parents[2]


def _api() -> dict:

    from megatron_ext.replay import RouteReplay
    from megatron_ext.replay.keyed_router_replay import KeyedRouterReplay
    from tests.replay.replay_model import tiny_replay_model

    torch.manual_seed(7)
    model = tiny_replay_model(recompute=True)
    tokens, positions = batch(1)
    recorded = record(model, tokens, positions).numpy()  # [B, S, L, K] uint8
    with torch.no_grad():  # perturb: the model's own routing changes
        for router in routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 3.0)
    before = [r.router_replay for r in routers(model)]
    # The caller's ids as int64 with -1 for a missing row; a self-padded batch: the last 4
    # positions of sample 0 copy its positions 0..3 (their tokens and, so, their routes).
    engine = recorded.astype(np.int64)
    engine[1, 5] = -1
    src_index = np.tile(np.arange(SEQ), (BATCH, 1))
    src_index[0, -4:] = np.arange(4)
    tokens[0, -4:] = tokens[0, :4]
    want = recorded.copy()
    want[0, -4:] = recorded[0, :4]
    log, handles = capture_maps(model)
    with RouteReplay(model) as replay:
        keyed = all(isinstance(r.router_replay, KeyedRouterReplay) for r in routers(model))
        key = replay.set_routes(engine, src_index=src_index)
        model(tokens, positions, None, labels=tokens).sum().backward()  # forward + recompute
        replay.clear()
        next_key = replay.set_routes(torch.from_numpy(recorded[0]))  # one sequence [T, L, K]
        replay.clear()
    for h in handles:
        h.remove()
    exact, rows = 0, 0
    for ordinal, router in enumerate(routers(model)):
        routes_NK = want[:, :, ordinal].transpose(1, 0, 2).reshape(-1, 2)  # rows s * B + b
        missing = np.zeros((SEQ, BATCH), bool)
        missing[5, 1] = True
        missing = missing.reshape(-1)
        for routing_map in log[router.layer_number]:  # the forward and the recompute
            got = routing_map.numpy()
            expected = np.zeros_like(got)
            np.put_along_axis(expected, routes_NK.astype(np.int64), True, axis=1)
            rows += int((~missing).sum())
            exact += int(((got == expected).all(-1) & ~missing).sum())
    restored = [r.router_replay for r in routers(model)] == before
    return {
        "keyed": keyed, "key": key, "next_key": next_key, "rows": rows, "exact": exact,
        "restored": restored, "calls": [len(v) for v in log.values()],
    }  # fmt: skip


def test_route_replay_installs_the_callers_routes_with_self_pads_and_recompute() -> None:
    (r,) = run_distributed(_api, 1)
    assert r["keyed"] and r["restored"], r
    assert r["key"] == (0, 0) and r["next_key"] == (1, 0), r  # keys per step, counted per chunk
    assert r["calls"] == [2, 2], r  # each router: the forward and the recompute in backward
    # 2 layers x 2 calls x (2 x 16 positions - 1 missing row): every recorded row exact.
    assert r["rows"] == 2 * 2 * (BATCH * SEQ - 1) == r["exact"], r


def test_the_example_replays_an_ingested_dump_in_its_own_loop(tmp_path) -> None:
    run = launch(
        ["--cpu", "--steps", "2", "--workdir", str(tmp_path)],
        module="examples.replay_in_your_loop",
        cwd=ROOT,
    )
    assert run.returncode == 0, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if line.startswith('{"replay_rows"')]
    assert len(lines) == 1, run.output[-3000:]
    result = json.loads(lines[0])
    # 2 steps x 2 micro-batches x 2 ranks x (4 x 32 tokens - 4 last ones the engine never
    # routes) x 2 layers x 2 calls (forward, recompute): every one as the engine routed it.
    assert result["replay_rows"] == 2 * 2 * 2 * (4 * 32 - 4) * 2 * 2, result
    assert result["replay_exact"] == result["replay_rows"], result
    assert len(result["loss"]) == 2 and all(np.isfinite(result["loss"])), result
    native, replayed = result["logprob_mismatch"]["native"], result["logprob_mismatch"]["replay"]
    assert 0 < replayed < native / 5, result  # seen: 1.7e-4 vs 3.8e-3
    assert (tmp_path / "rollouts_routes.routes.json").is_file()
