"""What tools/gpu/gpu_check.py measures after its alignment proof, on the same device.

- :func:`replay_checks`: route replay (no sync in ``install()``, exact replay of a perturbed
  model, the ``replay`` benchmark's ratios);
- :func:`alignment_table`: the ``alignment`` benchmark's EP=1 rows (the dispatcher's cost
  figures).

Both run Megatron's real classes and megatron_ext's benchmark code; on CPU (``--cpu-smoke``) at
small sizes.
"""

import statistics

import torch


def replay_checks(device: str, smoke: bool) -> dict:
    """Route replay on this device: ``install()`` under the sync detector, routes replayed
    exactly, and the ``replay`` benchmark's forward times (replay at native speed).

    A tiny MoE GPTModel (local spec, 8 experts, top-2) records Megatron's routes (RECORD), its
    weights are perturbed so that it routes otherwise (checked), our binding installs the routes
    as uint8 ``[B, S, L, K]`` under ``record_host_syncs`` (CUDA's sync debug mode "error" on a
    GPU: a sync raises), and a forward must route every token as recorded.
    Then ``megatron_ext.bench.replay_measurements.measure`` times native, Megatron's
    RouterReplay and ours, interleaved (wall time around a device synchronize on a GPU).
    """
    from megatron_ext.bench.replay_measurements import measure
    from megatron_ext.bench.replay_model import record_routes, replay_model, routes_match
    from megatron_ext.bench.round_timing import paired_ratio
    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.testing import record_host_syncs

    batch, seq, layers, rounds, inner = (2, 128, 2, 2, 1) if smoke else (4, 512, 4, 15, 3)
    model, forward, routers = replay_model(batch, seq, layers, device)
    recorded, routes_BSLK = record_routes(routers, forward, batch, seq)
    with torch.no_grad():  # the model now routes otherwise: replay must bring the routes back
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1])) for r in routers]
    forward()
    native_as_recorded = routes_match(maps, recorded)
    maps.clear()
    binding = RouteReplayBinding(model, "replay", missing_route_policy="native")
    with record_host_syncs() as syncs:
        binding.install(routes_BSLK, key=0, has_missing=False)
    forward()
    replayed = routes_match(maps, recorded)
    binding.clear()
    binding.remove()
    for hook in hooks:
        hook.remove()
    r = measure(batch, seq, layers, rounds, inner, device=device)
    times, step = r["times"], r["step_times"]
    out = {
        "install_host_syncs": list(syncs),
        "replayed_exactly": replayed,
        "native_routes_differ": not native_as_recorded,  # else the replay check proves nothing
        "rounds": rounds,
    }
    for name in ("native_again", "megatron", "ours", "ours_unknown", "install"):
        out[f"{name}_over_native"] = paired_ratio(times, name, "native")
    out["ours_over_megatron"] = paired_ratio(times, "ours", "megatron")
    out["step_ours_over_megatron_batch"] = paired_ratio(step, "ours", "megatron_batch")
    out["ms_native"] = statistics.median(times["native"])
    out["ok"] = not syncs and replayed and not native_as_recorded
    return out


def alignment_table(device: str, smoke: bool) -> list[dict]:
    """The dispatcher's cost figures on this device: the ``alignment`` benchmark's EP=1 rows.

    Megatron's unaligned all-to-all and all-gather dispatchers beside megatron_ext's aligned ones
    (fp8, mxfp8, nvfp4), dispatch + combine, interleaved rounds, median paired ratios, the same
    code as ``megatron-ext bench`` (which runs on CPU); on a GPU each span is closed by a device
    synchronize. 48 and 8192 tokens at hidden 1024 (the smoke run: 48 tokens, hidden 64, 2
    rounds). One GPU, so EP=1 only.
    """
    from megatron_ext.bench.alignment_rows import COLUMNS, measure_rows

    tokens, hidden, rounds, whole = ([48], 64, 2, False) if smoke else ([48, 8192], 1024, 15, True)
    label = "cuda" if device == "cuda" else "glibc"  # CPU: malloc's defaults (no mallopt here)
    rows = measure_rows(tokens, hidden, rounds, label, whole, device=device)
    return [dict(zip(COLUMNS, row, strict=True)) for row in rows]  # every column, named
