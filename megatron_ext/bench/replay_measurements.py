"""The ``replay`` benchmark's measurements on one rank (:mod:`megatron_ext.bench.replay`).

On one model and batch (:mod:`.replay_model`): route bytes per token per MoE layer, forward times of
native routing, Megatron's ``REPLAY_FORWARD`` and our binding, and the replay step alone. Run in a
gloo rank on CPU (the registered benchmark) or on one GPU (tools/gpu/gpu_check.py).
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
    from megatron_ext.replay.binding import RouteReplayBinding

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with other jobs: one thread is steadier
    model, forward, routers = replay_model(batch, seq, layers, device)
    clock = synchronized_clock if torch.device(device).type == "cuda" else time.thread_time
    recorded, routes_BSLK = record_routes(routers, forward, batch, seq)
    per_token_layer = batch * seq * layers
    megatron_bytes = sum(t.nbytes for t in recorded) / per_token_layer
    ours_bytes = routes_BSLK.nbytes / per_token_layer
    inference_bytes = torch.empty(batch * seq, layers, 2, dtype=torch.int32).nbytes / (
        per_token_layer
    )
    theirs = [r.router_replay for r in routers]  # Megatron's instances, before the binding
    binding = RouteReplayBinding(model, "replay", missing_route_policy="native")
    ours = [r.router_replay for r in routers]
    variants = _forward_variants(routers, forward, theirs, ours, binding, recorded, routes_BSLK)
    times = interleaved_rounds(
        {
            "native": variants["native"],
            "native_again": variants["native"],  # control: the same code, one more variant
            "megatron": variants["megatron"],
            "ours": variants["ours"],
            "ours_unknown": variants["ours_unknown"],
            "install": variants["install"],
        },
        rounds,
        clock,
        inner=inner,
    )
    # The timed variants do the same work: every one routes exactly as recorded (the model is
    # the recording one), checked once, after the rounds.
    _check_routes(routers, variants, recorded)
    _use(routers, ours)
    device_bytes = _device_bytes(binding, routes_BSLK, per_token_layer)
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


def _use(routers: list, instances: list) -> None:
    """Puts ``instances`` (Megatron's ``RouterReplay`` objects, or our binding's) in the routers."""
    for router, instance in zip(routers, instances, strict=True):
        router.router_replay = instance


def _forward_variants(
    routers, forward, theirs, ours, binding, recorded, routes_BSLK
) -> dict[str, Callable[[], None]]:
    """The timed forwards: native routing, Megatron's replay, ours (packs known to have no
    missing row, or unknown), and our per-micro-batch install alone."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def native():
        _use(routers, theirs)  # no action set: Megatron's instances route natively
        forward()

    def megatron_replay():
        _use(routers, theirs)
        for instance, target in zip(theirs, recorded, strict=True):  # set_replay_data
            instance.set_target_indices(target)
            instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        forward()
        for instance in theirs:
            instance.clear_indices()
            instance.clear_router_replay_action()

    def ours_replay(has_missing):
        def run():
            _use(routers, ours)
            binding.install(routes_BSLK, key=0, has_missing=has_missing)
            forward()
            binding.clear()

        return run

    def install_only():  # the per-micro-batch part of "ours" alone: slicing, layer-major copy
        binding.install(routes_BSLK, key=0, has_missing=False)
        binding.clear()

    return {
        "native": native,
        "megatron": megatron_replay,
        "ours": ours_replay(False),
        "ours_unknown": ours_replay(None),
        "install": install_only,
    }


def _check_routes(routers, variants: dict[str, Callable[[], None]], recorded) -> None:
    """Asserts that each forward variant routes exactly as ``recorded``."""
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    for name in ("native", "megatron", "ours", "ours_unknown"):
        maps.clear()
        variants[name]()
        assert routes_match(maps, recorded)
    for hook in hooks:
        hook.remove()


def _device_bytes(binding, routes_BSLK, per_token_layer: int) -> dict[str, float]:
    """Bytes per token per layer our binding keeps on the device, by variant."""
    device_bytes = {}
    for name, has_missing in (("ours", False), ("ours_unknown", None)):
        binding.install(routes_BSLK, key=0, has_missing=has_missing)
        # Everything install() keeps per micro-batch: the narrow rows [L, N, K] and, when the
        # micro-batch may have missing rows, the bool mask [L, N] (1 B/token/layer).
        device_bytes[name] = binding.device_bytes()[0] / per_token_layer
        binding.clear()
    return device_bytes


#: Micro-batches per timed call of the replay step.
_STEP_REPS = 50


def _replay_step_times(
    binding, ours, theirs, recorded, routes_BSLK, rounds, inner, clock=time.thread_time
) -> dict:
    """The replay step alone: each MoE layer's top-k call on fixed scores, per micro-batch."""
    # What differs between the variants and nothing else (the rest of a forward is the same work).
    num_tokens, topk = recorded[0].shape
    scores = torch.randn(num_tokens, 8, device=routes_BSLK.device).softmax(-1)
    variants, from_batch = _step_variants(binding, ours, theirs, recorded, routes_BSLK, scores)
    # Same indices from every replay (the check that the timed calls do the same work), before
    # the rounds.
    for target_from_batch, target in zip(from_batch(), recorded, strict=True):
        assert torch.equal(target_from_batch, target)
    binding.install(routes_BSLK, key=0, has_missing=False)
    for instance, target in zip(ours, recorded, strict=True):
        got = instance.get_replay_topk(scores, topk, default_compute_topk=_native_topk)[1]
        assert torch.equal(got, target)
    binding.clear()
    times = interleaved_rounds(variants, rounds, clock, inner=inner)
    return {name: [t / _STEP_REPS for t in ts] for name, ts in times.items()}


def _native_topk(s, k, num_groups=None, group_topk=None):
    """Megatron's native top-k, without groups."""
    return torch.topk(s, k=k, dim=1)


def _step_variants(
    binding, ours, theirs, recorded, routes_BSLK, scores
) -> tuple[dict[str, Callable[[], None]], Callable[[], list[torch.Tensor]]]:
    """The timed replay steps, each ``_STEP_REPS`` micro-batches, and the glue that feeds
    Megatron's replay from a batch ``[B, S, L, K]``.

    Megatron's native top-k; Megatron's ``RouterReplay`` with its per-layer targets set
    (``set_target_indices``, the action) then ``get_replay_topk``; the same fed from the batch by
    the glue its users write (router rows, one int64 target per layer); ours ``install()`` then
    ``get_replay_topk`` of every layer.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    num_tokens, topk = recorded[0].shape
    recorded_shape = routes_BSLK.shape[2:]

    def native():
        for _ in range(_STEP_REPS):
            for _ in theirs:
                _native_topk(scores, topk)

    def megatron_with(targets_of: Callable[[], list[torch.Tensor]]):
        def run():
            for _ in range(_STEP_REPS):
                for instance, target in zip(theirs, targets_of(), strict=True):
                    instance.set_target_indices(target)
                    instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                for instance in theirs:
                    instance.get_replay_topk(scores, topk, default_compute_topk=_native_topk)
                for instance in theirs:
                    instance.clear_indices()
                    instance.clear_router_replay_action()

        return run

    def from_batch() -> list[torch.Tensor]:  # the glue a Megatron user writes
        rows_NLK = routes_BSLK.transpose(0, 1).reshape(num_tokens, *recorded_shape)
        return [rows_NLK[:, layer].long() for layer in range(len(theirs))]

    def mine():
        for _ in range(_STEP_REPS):
            binding.install(routes_BSLK, key=0, has_missing=False)
            for instance in ours:
                instance.get_replay_topk(scores, topk, default_compute_topk=_native_topk)
            binding.clear()

    variants = {
        "native": native,
        "native_again": native,  # control, as in the forward rounds
        "megatron": megatron_with(lambda: recorded),
        "megatron_batch": megatron_with(from_batch),
        "ours": mine,
    }
    return variants, from_batch
