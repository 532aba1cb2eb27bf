"""The ``replay`` benchmark's measurements on one rank (:mod:`megatron_ext.bench.replay`).

:func:`measure` builds the benchmark's model (:mod:`.replay_model`), records its routes with
Megatron's ``RouterReplay`` and reports, on the same model and batch: route bytes per token per
MoE layer (ours, Megatron's targets, Megatron inference's buffer dtype, what our binding keeps on
the device), forward times of native routing, Megatron's ``REPLAY_FORWARD`` and our binding
(:func:`~.round_timing.interleaved_rounds`), and the replay step alone without the model
(:func:`_replay_step_times`). The timed variants are checked to do the same work: every forward
variant routes exactly as recorded (once, after the rounds), and every replay step returns the
recorded indices (before its rounds). Run in a gloo rank on CPU (the registered benchmark) or on
one GPU (tools/gpu/gpu_check.py).
"""

import time
from collections.abc import Callable

import torch

from megatron_ext.bench.replay_model import record_routes, replay_model, routes_match
from megatron_ext.bench.round_timing import interleaved_rounds, synchronized_clock


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
        device_bytes[name] = binding.device_bytes()[0] / (batch * seq * layers)
        binding.clear()
    step_times = _replay_step_times(
        binding, ours, theirs, recorded, routes_BSLK, rounds, inner, clock
    )
    # Cached once per (device, B, S), shared by every layer and micro-batch: int64 row index.
    index_bytes = binding.device_bytes()[1] / (batch * seq)
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
