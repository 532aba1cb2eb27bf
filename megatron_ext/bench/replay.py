"""Benchmark: route replay memory and forward time, ours vs Megatron's RouterReplay vs native.

One rank, real tiny MoE ``GPTModel`` (local spec, 8 experts, top-2, CPU), side by side in one run:

- route bytes per token per MoE layer: our uint8 route buffer (what is stored, read and copied
  host-to-device), Megatron's ``RouterReplay`` targets as it records them (int64), and Megatron
  inference's ``RoutingMetadata`` buffer dtype (int32); plus what our binding keeps installed on
  the device per micro-batch, measured as the nbytes of its tensors (the uint8 rows, widened per
  router call, and the ``native`` policy's bool missing-row mask), and its cached row index;
- forward time: native routing, Megatron's ``REPLAY_FORWARD`` with ``set_replay_data``, and
  megatron_ext's keyed binding (install + forward, ``native`` missing-row policy, i.e. including
  the router's own top-k for the ``where``). Medians over repeats; ratios are to native.
"""

import statistics
import time

import torch

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.testing import run_distributed


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _worker(batch: int, seq: int, layers: int, repeats: int) -> dict:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.replay.layout import router_row_positions, rows_for_router
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    torch.manual_seed(0)
    config = tiny_moe_config(
        num_layers=layers, hidden_size=128, moe_ffn_hidden_size=128, moe_enable_routing_replay=True
    )
    model = build_tiny_gpt(config, vocab_size=256, max_seq_len=seq).eval()
    tokens = torch.randint(0, 256, (batch, seq))
    positions = torch.arange(seq).expand(batch, seq)

    def forward():
        with torch.no_grad():
            model(tokens, positions, attention_mask=None)

    # Megatron RECORD gives the reference routes (and its own int64 buffers).
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    forward()
    recorded = RouterReplay.get_recorded_data()  # per layer [S*B, K] int64, router row order
    RouterReplay.clear_global_router_replay_action()
    megatron_bytes = sum(t.nbytes for t in recorded) / (batch * seq * layers)

    # Our uint8 [B, S, L, K] from the same routes (router rows are s-major).
    rows_NLK = torch.stack(recorded, dim=1).to(torch.uint8)
    order = router_row_positions(batch, seq)
    routes_BSLK = torch.empty_like(rows_NLK)
    routes_BSLK[order] = rows_NLK
    routes_BSLK = routes_BSLK.reshape(batch, seq, layers, -1)
    assert torch.equal(rows_for_router(routes_BSLK, order), rows_NLK)
    ours_bytes = routes_BSLK.nbytes / (batch * seq * layers)
    inference_bytes = torch.empty(batch * seq, layers, 2, dtype=torch.int32).nbytes / (
        batch * seq * layers
    )

    native_ms = _median_ms(forward, repeats)

    def megatron_replay():
        RouterReplay.set_replay_data(recorded)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        forward()
        RouterReplay.clear_global_indices()

    megatron_ms = _median_ms(megatron_replay, repeats)
    RouterReplay.clear_global_router_replay_action()

    binding = RouteReplayBinding(model, "replay", missing_route_policy="native")

    def ours_replay():
        binding.install(routes_BSLK, key=0)
        forward()
        binding.clear()

    ours_ms = _median_ms(ours_replay, repeats)
    binding.install(routes_BSLK, key=0)
    # Everything install() keeps per micro-batch: the uint8 rows [N, K] and, with the native
    # policy and a route that may have missing rows, the bool mask missing_N (1 B/token/layer).
    tokens_layers = batch * seq * layers
    device_bytes = (
        sum(t.nbytes for pair in binding._targets.values() for t in pair if t is not None)
        / tokens_layers
    )
    # Cached once per (device, B, S), shared by every layer and micro-batch: int64 row index.
    index_bytes = sum(t.nbytes for t in binding._device_positions.values()) / (batch * seq)
    binding.remove()
    return {
        "ours_bytes": ours_bytes,
        "megatron_bytes": megatron_bytes,
        "inference_bytes": inference_bytes,
        "device_bytes": device_bytes,
        "index_bytes": index_bytes,
        "native_ms": native_ms,
        "megatron_ms": megatron_ms,
        "ours_ms": ours_ms,
    }


@register_benchmark("replay")
def replay(quick: bool) -> BenchResult:
    """Route bytes per token per layer and replay forward time vs native routing."""
    batch, seq, layers, repeats = (2, 128, 2, 5) if quick else (4, 512, 4, 15)
    (r,) = run_distributed(_worker, 1, batch, seq, layers, repeats)
    rows = [
        ["native routing (no replay)", "-", round(r["native_ms"], 2), 1.0],
        [
            "Megatron RouterReplay (REPLAY_FORWARD)",
            r["megatron_bytes"],
            round(r["megatron_ms"], 2),
            round(r["megatron_ms"] / r["native_ms"], 3),
        ],
        ["Megatron inference RoutingMetadata (int32)", r["inference_bytes"], "-", "-"],
        [
            "megatron_ext route buffer (uint8, stored/H2D)",
            r["ours_bytes"],
            round(r["ours_ms"], 2),
            round(r["ours_ms"] / r["native_ms"], 3),
        ],
        [
            "megatron_ext installed on device (per micro-batch, rows + missing mask)",
            r["device_bytes"],
            "-",
            "-",
        ],
        [
            "megatron_ext row index (once per shape; bytes/token, all layers)",
            r["index_bytes"],
            "-",
            "-",
        ],
    ]
    return BenchResult(
        title="Route replay: bytes per token per MoE layer and forward time (top-2, 8 experts)",
        columns=["path", "route bytes/token/layer", "forward ms (median)", "time vs native"],
        rows=rows,
        notes=(
            f"Tiny MoE GPTModel on CPU, B={batch}, S={seq}, {layers} MoE layers, hidden 128, "
            f"{repeats} repeats. uint8 costs K = 2 bytes per token per layer; Megatron keeps "
            "int64 targets (8K) and its inference buffer is int32 (4K). Installed on device, "
            "the native missing-route policy adds a 1-byte bool mask per token per layer "
            "(measured nbytes of what install() keeps). Our forward includes "
            "install() (CP/SP slicing), the per-call int64 widening and the native top-k used "
            "for missing rows."
        ),
    )
