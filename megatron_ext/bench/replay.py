"""Benchmark: route replay memory and forward time, ours vs Megatron's RouterReplay vs native.

One rank, real tiny MoE ``GPTModel`` (local spec, 8 experts, top-2, CPU, one intra-op thread),
side by side in one process:

- route bytes per token per MoE layer: our uint8 route buffer (what is stored, read and copied
  host-to-device), Megatron's ``RouterReplay`` targets as it records them (int64), and Megatron
  inference's ``RoutingMetadata`` buffer dtype (int32); plus what our binding keeps installed on
  the device per micro-batch, measured as the nbytes of its tensors (the uint8 rows, widened to int64
  once per pass, and, when the micro-batch may have missing rows, the ``native`` policy's bool
  mask), and its cached row index;
- forward time of five variants (and ``install()`` alone), **interleaved round by round**
  (each round runs every variant, in an order where each follows every other equally often
  (:mod:`.rounds`), so drift of a shared machine hits all of them alike; a round keeps each
  variant's fastest of a few passes), timed in thread CPU time (the machine's cores are shared;
  one intra-op thread): native routing, Megatron's ``REPLAY_FORWARD`` with its targets set,
  megatron_ext's binding with the dataset's host count saying the micro-batch has no missing
  row (``has_missing=False``: install + gather, the fast path), the binding with
  ``has_missing`` unknown (missing mask, native top-k and ``where`` in every router), and native
  routing once more as a control (the same code: its ratio to native is what identical code
  measures in the run). Reported per variant: the median time, and the median of the per-round
  paired ratios to native (and to Megatron's replay) with their min and max;
- the replay step alone (no model): what differs between the variants, per micro-batch (see
  :func:`_replay_step_times`), the same way.
"""

import statistics
import time
from collections.abc import Callable

import torch

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.bench.rounds import round_order
from megatron_ext.testing import run_distributed


def interleaved_rounds(
    variants: dict[str, Callable[[], None]],
    rounds: int,
    clock: Callable[[], float] = time.thread_time,
    inner: int = 1,
) -> dict[str, list[float]]:
    """Times every variant in every round (in :func:`~megatron_ext.bench.rounds.round_order`'s
    order) after one warm-up pass.

    A round runs its order ``inner`` times over and keeps each variant's fastest call,
    so a burst of other work on a shared machine during one call does not decide the round.

    Args:
        variants: ``{name: fn}``.
        rounds: Rounds timed.
        clock: Seconds; by default this thread's CPU time, which a shared machine's other jobs
            do not inflate (with one intra-op thread every op runs on the calling thread).
        inner: Passes per round.

    Returns:
        ``{name: [ms of round 0, ms of round 1, ...]}``: entry ``r`` of two variants is a pair.
    """
    names = list(variants)
    for name in names:
        variants[name]()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        best = dict.fromkeys(names, float("inf"))
        for _ in range(inner):
            for name in round_order(names, r):
                start = clock()
                variants[name]()
                best[name] = min(best[name], (clock() - start) * 1e3)
        for name in names:
            times[name].append(best[name])
    return times


def paired_ratio(times: dict[str, list[float]], name: str, base: str) -> dict[str, float]:
    """Median, min and max over rounds of ``times[name][r] / times[base][r]``."""
    ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def synchronized_clock() -> float:
    """Wall seconds after the GPU has finished its queued work (a GPU runs kernels
    asynchronously, and the host thread's CPU time does not see them)."""
    torch.cuda.synchronize()
    return time.perf_counter()


def measure(batch: int, seq: int, layers: int, rounds: int, inner: int, device="cpu") -> dict:
    """The benchmark's measurements on one rank. ``device``: "cpu" (the registered benchmark:
    thread CPU time, one intra-op thread) or "cuda" (tools/gpu/gpu_check.py: wall time around a
    device synchronize; the routes live on the device, moved with the batch as in training)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_ext.replay.binding import RouteReplayBinding

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with other jobs: one thread is steadier
    model, forward, routers = replay_model(batch, seq, layers, device)
    clock = synchronized_clock if torch.device(device).type == "cuda" else time.thread_time
    recorded, routes_BSLK = record_routes(routers, forward, batch, seq)
    megatron_bytes = sum(t.nbytes for t in recorded) / (batch * seq * layers)
    ours_bytes = routes_BSLK.nbytes / (batch * seq * layers)
    inference_bytes = torch.empty(batch * seq, layers, 2, dtype=torch.int32).nbytes / (
        batch * seq * layers
    )
    theirs = [r.router_replay for r in routers]  # Megatron's instances, before the binding
    binding = RouteReplayBinding(model, "replay", missing_route_policy="native")
    ours = [r.router_replay for r in routers]

    def use(instances):
        for router, instance in zip(routers, instances, strict=True):
            router.router_replay = instance

    def native():
        use(theirs)  # no action set: Megatron's instances route natively
        forward()

    def megatron_replay():
        use(theirs)
        for instance, target in zip(theirs, recorded, strict=True):  # set_replay_data
            instance.set_target_indices(target)
            instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        forward()
        for instance in theirs:
            instance.clear_indices()
            instance.clear_router_replay_action()

    def ours_replay(has_missing):
        def run():
            use(ours)
            binding.install(routes_BSLK, key=0, has_missing=has_missing)
            forward()
            binding.clear()

        return run

    def install_only():  # the per-micro-batch part of "ours" alone: slicing, layer-major copy
        binding.install(routes_BSLK, key=0, has_missing=False)
        binding.clear()

    times = interleaved_rounds(
        {
            "native": native,
            "native_again": native,  # control: the same code, timed as one more variant
            "megatron": megatron_replay,
            "ours": ours_replay(False),
            "ours_unknown": ours_replay(None),
            "install": install_only,
        },
        rounds,
        clock,
        inner=inner,
    )
    # Every variant routes exactly as recorded (the model is the recording one): checked once.
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    for variant in (native, megatron_replay, ours_replay(False), ours_replay(None)):
        maps.clear()
        variant()
        assert routes_match(maps, recorded)
    for hook in hooks:
        hook.remove()
    use(ours)
    device_bytes = {}
    for name, has_missing in (("ours", False), ("ours_unknown", None)):
        binding.install(routes_BSLK, key=0, has_missing=has_missing)
        # Everything install() keeps per micro-batch: the narrow rows [L, N, K] and, when the
        # micro-batch may have missing rows, the bool mask [L, N] (1 B/token/layer).
        device_bytes[name] = sum(
            t.nbytes for pair in binding._targets.values() for t in pair if t is not None
        ) / (batch * seq * layers)
        binding.clear()
    step_times = _replay_step_times(
        binding, ours, theirs, recorded, routes_BSLK, rounds, inner, clock
    )
    # Cached once per (device, B, S), shared by every layer and micro-batch: int64 row index.
    index_bytes = sum(t.nbytes for t in binding._device_positions.values()) / (batch * seq)
    binding.remove()
    torch.set_num_threads(threads)
    return {
        "ours_bytes": ours_bytes,
        "megatron_bytes": megatron_bytes,
        "inference_bytes": inference_bytes,
        "device_bytes": device_bytes,
        "index_bytes": index_bytes,
        "times": times,
        "step_times": step_times,
    }


def replay_model(
    batch: int, seq: int, layers: int, device="cpu"
) -> tuple[torch.nn.Module, Callable[[], None], list]:
    """The benchmark's model: a tiny MoE ``GPTModel`` (local spec, 8 experts, top-2, hidden 128,
    routing replay enabled) in eval mode on ``device``, seeded; returns it, its no-grad forward on
    one fixed random ``[batch, seq]`` batch, and its routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    torch.manual_seed(0)
    config = tiny_moe_config(
        num_layers=layers, hidden_size=128, moe_ffn_hidden_size=128, moe_enable_routing_replay=True
    )
    model = build_tiny_gpt(config, vocab_size=256, max_seq_len=seq).eval().to(device)
    tokens = torch.randint(0, 256, (batch, seq)).to(device)
    positions = torch.arange(seq, device=device).expand(batch, seq)

    def forward() -> None:
        with torch.no_grad():
            model(tokens, positions, attention_mask=None)

    return model, forward, [m for m in model.modules() if isinstance(m, TopKRouter)]


def routes_match(maps_NE: list[torch.Tensor], recorded_NK: list[torch.Tensor]) -> bool:
    """Every router's routing map (one per layer, in forward order) chose exactly its recorded
    top-k experts."""
    return len(maps_NE) == len(recorded_NK) and all(
        torch.equal(m.nonzero()[:, 1].view(-1, t.shape[1]), t.sort(-1).values)
        for m, t in zip(maps_NE, recorded_NK, strict=True)
    )


def record_routes(
    routers: list, forward: Callable[[], None], batch: int, seq: int
) -> tuple[list, torch.Tensor]:
    """Megatron's RECORD of one ``forward`` by ``routers`` (their own ``RouterReplay`` instances,
    not Megatron's process-wide list, which also holds any other model's): per layer ``[S*B, K]``
    int64 in router row order, and the same routes as megatron_ext's uint8 ``[B, S, L, K]`` on
    the model's device."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_ext.replay.layout import router_row_positions, rows_for_router

    instances = [r.router_replay for r in routers]
    for instance in instances:
        instance.set_router_replay_action(RouterReplayAction.RECORD)
    forward()
    recorded = [instance.get_recorded_indices() for instance in instances]
    for instance in instances:
        instance.clear_router_replay_action()
    rows_NLK = torch.stack(recorded, dim=1).to(torch.uint8)  # router rows are s-major
    order = router_row_positions(batch, seq).to(rows_NLK.device)
    routes_BSLK = torch.empty_like(rows_NLK)
    routes_BSLK[order] = rows_NLK
    routes_BSLK = routes_BSLK.reshape(batch, seq, len(recorded), -1)
    assert torch.equal(rows_for_router(routes_BSLK, order), rows_NLK)
    return recorded, routes_BSLK


def _replay_step_times(
    binding, ours, theirs, recorded, routes_BSLK, rounds, inner, clock=time.thread_time
) -> dict:
    """The replay step alone: each MoE layer's top-k call on fixed scores, per micro-batch.

    What differs between the variants and nothing else (the rest of a forward is the same
    work): Megatron's native top-k; Megatron's ``RouterReplay`` with its per-layer targets set
    (``set_target_indices``, the action) then ``get_replay_topk``; ours ``install()`` then
    ``get_replay_topk`` of every layer; and Megatron's replay fed from the same batch
    ``[B, S, L, K]`` by the glue its users write (router rows, one int64 target per layer). Each
    call runs ``reps`` micro-batches.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    num_tokens, topk = recorded[0].shape
    recorded_shape = routes_BSLK.shape[2:]
    scores = torch.randn(num_tokens, 8, device=routes_BSLK.device).softmax(-1)
    reps = 50

    def native_topk(s, k, num_groups=None, group_topk=None):  # Megatron's, without groups
        return torch.topk(s, k=k, dim=1)

    def native():
        for _ in range(reps):
            for _ in theirs:
                native_topk(scores, topk)

    def megatron_with(targets_of: Callable[[], list[torch.Tensor]]):
        def run():
            for _ in range(reps):
                for instance, target in zip(theirs, targets_of(), strict=True):
                    instance.set_target_indices(target)
                    instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                for instance in theirs:
                    instance.get_replay_topk(scores, topk, default_compute_topk=native_topk)
                for instance in theirs:
                    instance.clear_indices()
                    instance.clear_router_replay_action()

        return run

    def from_batch() -> list[torch.Tensor]:  # the glue a Megatron user writes
        rows_NLK = routes_BSLK.transpose(0, 1).reshape(num_tokens, *recorded_shape)
        return [rows_NLK[:, layer].long() for layer in range(len(theirs))]

    def mine():
        for _ in range(reps):
            binding.install(routes_BSLK, key=0, has_missing=False)
            for instance in ours:
                instance.get_replay_topk(scores, topk, default_compute_topk=native_topk)
            binding.clear()

    # Same indices from every replay (the check that the timed calls do the same work).
    for target_from_batch, target in zip(from_batch(), recorded, strict=True):
        assert torch.equal(target_from_batch, target)
    binding.install(routes_BSLK, key=0, has_missing=False)
    for instance, target in zip(ours, recorded, strict=True):
        got = instance.get_replay_topk(scores, topk, default_compute_topk=native_topk)[1]
        assert torch.equal(got, target)
    binding.clear()
    times = interleaved_rounds(
        {
            "native": native,
            "native_again": native,  # control, as in the forward rounds
            "megatron": megatron_with(lambda: recorded),
            "megatron_batch": megatron_with(from_batch),
            "ours": mine,
        },
        rounds,
        clock,
        inner=inner,
    )
    return {name: [t / reps for t in ts] for name, ts in times.items()}


def _step_rows(step_times: dict[str, list[float]], layers: int) -> list[list]:
    label = f"replay step alone, no model ({layers} layers' top-k + setup, per micro-batch): "
    names = {
        "native": "native top-k",
        "native_again": "native top-k again (control: the same code)",
        "megatron": "Megatron RouterReplay, targets precomputed per layer",
        "megatron_batch": "Megatron RouterReplay fed from the batch (users' glue)",
        "ours": "megatron_ext install() + replay",
    }
    rows = []
    for name, text in names.items():
        cells = _ratio_cells(step_times, name)
        cells[0] = round(statistics.median(step_times[name]), 4)  # tenths of a microsecond
        rows.append([label + text, "-", *cells])
    return rows


def _ratio_cells(times: dict[str, list[float]], name: str) -> list:
    vs_native = paired_ratio(times, name, "native")
    vs_megatron = paired_ratio(times, name, "megatron")
    return [
        round(statistics.median(times[name]), 2),
        round(vs_native["median"], 3),
        f"{vs_native['min']:.3f}..{vs_native['max']:.3f}",
        round(vs_megatron["median"], 3),
        f"{vs_megatron['min']:.3f}..{vs_megatron['max']:.3f}",
    ]


@register_benchmark("replay")
def replay(quick: bool) -> BenchResult:
    """Route bytes per token per layer and replay forward time vs native routing."""
    batch, seq, layers, rounds, inner = (2, 128, 2, 9, 2) if quick else (4, 512, 4, 15, 3)
    (r,) = run_distributed(measure, 1, batch, seq, layers, rounds, inner)
    times, dash = r["times"], ["-"] * 5
    step = r["step_times"]
    vs_glue = paired_ratio(step, "ours", "megatron_batch")
    rows = [
        ["native routing (no replay)", "-", *_ratio_cells(times, "native")],
        [
            "native routing again (control: the same code, timed as another variant)",
            "-",
            *_ratio_cells(times, "native_again"),
        ],
        ["Megatron RouterReplay (REPLAY_FORWARD)", r["megatron_bytes"]]
        + _ratio_cells(times, "megatron"),
        ["Megatron inference RoutingMetadata (int32)", r["inference_bytes"], *dash],
        ["megatron_ext route buffer (uint8, stored/H2D), no missing row (data's host count)"]
        + [r["ours_bytes"], *_ratio_cells(times, "ours")],
        ["megatron_ext, missing rows unknown (mask, native top-k, where per layer)"]
        + [r["ours_bytes"], *_ratio_cells(times, "ours_unknown")],
        [
            "megatron_ext install() alone (per micro-batch; share of a native forward)",
            "-",
            round(statistics.median(times["install"]), 3),
            round(paired_ratio(times, "install", "native")["median"], 4),
            *dash[:3],
        ],
        [
            "megatron_ext installed on device per micro-batch: rows (no missing row)",
            r["device_bytes"]["ours"],
            *dash,
        ],
        [
            "megatron_ext installed on device per micro-batch: rows + missing mask",
            r["device_bytes"]["ours_unknown"],
            *dash,
        ],
        *_step_rows(r["step_times"], layers),
        [
            "megatron_ext row index (once per shape; bytes/token, all layers)",
            r["index_bytes"],
            *dash,
        ],
    ]
    return BenchResult(
        title="Route replay: bytes per token per MoE layer and forward time (top-2, 8 experts)",
        columns=[
            "path",
            "route bytes/token/layer",
            "ms (median)",
            "time vs native",
            "vs native min..max",
            "vs Megatron replay",
            "vs Megatron min..max",
        ],
        rows=rows,
        notes=(
            f"Tiny MoE GPTModel on CPU (1 intra-op thread), B={batch}, S={seq}, {layers} MoE "
            f"layers, hidden 128. {rounds} interleaved rounds: every round runs the variants "
            f"{inner} times over in an order where each follows every other equally often and "
            "keeps each one's fastest call, timed in thread CPU time (other jobs on the shared "
            "cores do not count); "
            "ratios are the median over rounds of the paired per-round ratio, with its "
            "min..max. The 'again (control)' rows time native routing a second time as one more "
            "variant: their ratios are what identical code measures in this run, the scale "
            "against which to read the others. uint8 costs K = 2 bytes per token per layer; Megatron "
            "keeps int64 targets (8K) and its inference buffer is int32 (4K). Our forward "
            "includes install() (CP/SP slicing, one gather) and the int64 widening, once per "
            "pass for all the stage's layers (routers save their int64 slice for backward, as "
            "Megatron's targets are int64); with the "
            "dataset's host count saying a micro-batch has no missing row (has_missing=False) "
            "no mask, native top-k or where is computed; with the count unknown, the native "
            "policy adds a 1-byte bool mask per token per layer and the router's own top-k. "
            "'replay step alone': only what differs between the variants (the rest of a "
            "forward is the same work), per micro-batch, on fixed scores, interleaved the same "
            "way: every MoE layer's top-k call plus the per-micro-batch setup. Megatron's "
            "RouterReplay is given its targets precomputed (int64, sliced per layer), or fed "
            "from the same [B, S, L, K] batch by the glue its users write (router rows, one "
            "int64 copy per layer; without CP/SP slicing); ours is install() + the calls: "
            f"{vs_glue['median']:.3f}x ({vs_glue['min']:.3f}..{vs_glue['max']:.3f}) the fed "
            "Megatron step. On CPU a gather of 1-byte elements costs about 10 ns each, so the "
            "install's one gather is most of ours."
        ),
        extra={"times_ms": times},
    )
