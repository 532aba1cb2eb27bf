"""Benchmark: what pads cost in the MoE layer, constant pads vs self pads vs skipped pads vs no padding.

Megatron's real tiny MoE GPTModel (local spec, 8 experts, top-2, alltoall dispatcher) at EP=2 on 2
gloo ranks, each rank's packs half padding: the first MoE layer's forward + backward per variant, as
paired per-round ratios to no padding, under glibc's malloc defaults and the caching setting every
``--cpu`` launch applies (the two halves of a 4-rank world, :mod:`.allocator_pair`).
"""

import statistics
import time
from typing import Any

import numpy as np
import torch

from megatron_ext.bench.allocator_pair import enter_half, paired_rounds
from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.testing import run_distributed
from megatron_ext.testing.distributed import shutdown_pools

VARIANTS = ("constant", "self", "skip", "no padding")


def _inputs(model, seq_len: int, num_packs: int, real_len: int) -> dict[str, tuple]:
    """Per variant: (first MoE layer input [S, B, H], padding mask [B, S]) from the model's forward."""
    from megatron_ext.data.padding import pad_pack
    from megatron_ext.training.corpus import CONSTANT_PAD_ID, corpus_stream

    rank = torch.distributed.get_rank()
    seen = {}
    hook = model.decoder.layers[0].mlp.register_forward_pre_hook(
        lambda m, args: seen.update(x=args[0].detach())
    )
    out = {}
    for variant in VARIANTS:
        tokens, positions, pads = [], [], []
        for b in range(num_packs):
            text = corpus_stream((rank * num_packs + b) * seq_len, real_len)
            if variant == "no padding":
                tokens.append(text)
                positions.append(np.arange(real_len))
                pads.append(np.zeros(real_len, dtype=bool))
                continue
            policy = "constant" if variant == "constant" else "self"
            pack = pad_pack(
                text, np.array([real_len]), seq_len, policy=policy, pad_id=CONSTANT_PAD_ID
            )
            tokens.append(pack.tokens_S)
            positions.append(pack.position_ids_S)
            pads.append(pack.pad_mask_S)
        with torch.no_grad():  # pads come after every real token: real tokens' states are the same
            model(torch.as_tensor(np.stack(tokens)), torch.as_tensor(np.stack(positions)), None)
        out[variant] = (seen["x"], torch.as_tensor(np.stack(pads)))
    hook.remove()
    return out


def _worker(seq_len: int, num_packs: int, hidden: int, rounds: int) -> dict:
    """One rank of the 4-rank world: its half's figures per variant (rank 0: glibc's)."""
    from megatron.core import parallel_state

    allocator = enter_half(ep=2)  # before anything is built
    group = parallel_state.get_expert_model_parallel_group()
    layers = _models(seq_len, hidden)
    inputs = _inputs(layers["dispatch"][0], seq_len, num_packs, seq_len // 2)
    step = _step(layers, inputs, group)
    counts = {}

    def timed(variant: str):
        def run() -> float:
            seconds, counts[variant] = step(variant)
            return seconds

        return run

    paired = paired_rounds({v: timed(v) for v in VARIANTS}, rounds, ep=2)
    times = {v: [t / 1e3 for t in paired["ms"]["glibc"][v]] for v in VARIANTS}
    out = {"allocator": allocator, "peak_rss_mib": paired["peak_rss_mib"]}
    for variant in VARIANTS:
        out[variant] = _figures(variant, counts[variant], times, paired, group)
    return out


def _models(seq_len: int, hidden: int) -> dict[str, tuple]:
    """``{pad routing mode: (model, its first MoE layer, PadRouting)}`` for dispatch and skip."""
    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.moe.pad_routing import PadRouting
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.testing.tiny_model import local_layer_spec
    from megatron_ext.training.corpus import VOCAB_SIZE
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    config = tiny_moe_config(
        hidden_size=hidden, ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden
    )
    layers = {}
    for mode in ("dispatch", "skip"):
        routing = PadRouting(mode)
        spec = with_aligned_moe(
            local_layer_spec(config), MoEAlignmentConfig(), padded_router=False, pad_routing=routing
        )
        torch.manual_seed(0)  # the same weights for both modes (experts seeded per EP rank)
        model = build_tiny_gpt(config, vocab_size=VOCAB_SIZE, max_seq_len=seq_len, layer_spec=spec)
        layers[mode] = (model, model.decoder.layers[0].mlp, routing)
    return layers


def _step(layers: dict[str, tuple], inputs: dict[str, tuple], group: Any) -> Any:
    """``step(variant) -> (seconds, rows)``: the MoE layer's forward + backward on the variant's
    input, timed, with the rows counted where they happen (all-to-all rows from the dispatcher's
    input splits, expert rows from what the experts received)."""
    from megatron_ext.moe.pad_routing import count_router_tokens

    def step(variant: str) -> tuple[float, dict]:
        _, moe, routing = layers["skip" if variant == "skip" else "dispatch"]
        x_SBH, pad_BS = inputs[variant]
        x = x_SBH.clone().requires_grad_(True)
        rows: list[torch.Tensor] = []
        hook = moe.experts.register_forward_pre_hook(lambda m, a: rows.append(a[1].clone()))
        routing.set_micro_batch(*count_router_tokens(pad_BS, tuple(pad_BS.shape)))
        torch.distributed.barrier(group)
        start = time.perf_counter()
        out, _ = moe(x, padding_mask=pad_BS)
        out.sum().backward()
        seconds = time.perf_counter() - start
        hook.remove()
        splits = moe.token_dispatcher.input_splits
        return seconds, {"a2a": int(np.sum(splits)), "expert": int(rows[0].sum())}

    return step


def _figures(variant: str, counts: dict, times: dict, paired: dict, group: Any) -> dict:
    """One variant's figures: rows summed over the EP group, its time ratios (collective)."""
    per_rank = torch.tensor([counts["expert"]], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, per_rank, group=group)
    received = torch.cat(gathered)
    totals = torch.tensor([counts["a2a"], counts["expert"]], dtype=torch.long)
    torch.distributed.all_reduce(totals, group=group)
    # Each round's time over that round's no-padding time: paired ratios cancel a shared
    # machine's drift.
    ratios = [t / b for t, b in zip(times[variant], times["no padding"], strict=True)]
    return {
        "a2a_rows": int(totals[0]),
        "expert_rows": int(totals[1]),
        "rank_peak_over_mean": float(received.max() / received.mean()),
        "time_ratio": statistics.median(ratios),
        "time_ratio_min": min(ratios),
        "time_ratio_max": max(ratios),
        "ms_median": 1e3 * statistics.median(times[variant]),
        "caching_ms_median": statistics.median(paired["ms"]["caching"][variant]),
        "caching_ratio": paired["ratio"][variant],
        "faults_glibc": int(statistics.median(paired["faults"]["glibc"][variant])),
        "faults_caching": int(statistics.median(paired["faults"]["caching"][variant])),
    }


@register_benchmark("pad_routing")
def pad_routing(quick: bool) -> BenchResult:
    """MoE-layer rows and time at 50 % padding: constant, self, skip, no padding (EP=2, alltoall)."""
    seq_len, num_packs, hidden, rounds = (128, 4, 128, 5) if quick else (512, 8, 256, 31)
    shutdown_pools()  # fresh workers: the caching half keeps its setting, shut down after
    args = (seq_len, num_packs, hidden, rounds)
    result = run_distributed(_worker, 4, *args, ep=2, timeout=1800)[0]
    shutdown_pools()
    assert result["allocator"] == "glibc"  # rank 0: the default half, whose rows the table shows
    skip, nopad = result["skip"], result["no padding"]
    for key in ("a2a_rows", "expert_rows", "rank_peak_over_mean"):  # the claim, checked every run
        assert skip[key] == nopad[key], f"skip {key} {skip[key]} != no padding {nopad[key]}"
    assert result["self"]["expert_rows"] > nopad["expert_rows"]  # pads were routed in dispatch
    return BenchResult(
        title="Pad routing: MoE-layer rows and time at 50 % padding (skip vs dispatch vs no padding)",
        columns=[
            "pads",
            "a2a rows",
            "expert rows",
            "time vs no padding (median, min-max)",
            "ms median",
            "EP-rank peak/mean",
            "ms median, caching malloc",
            "caching/glibc (median, min-max)",
            "faults/step glibc",
            "faults/step caching",
        ],
        rows=[_row(variant, result[variant]) for variant in VARIANTS],
        notes=_notes(seq_len, num_packs, hidden, rounds, result["peak_rss_mib"]),
        extra=result,
    )


def _row(variant: str, figures: dict) -> list:
    """One variant's row of the table."""
    return [
        variant,
        figures["a2a_rows"],
        figures["expert_rows"],
        f"{figures['time_ratio']:.3f} "
        f"({figures['time_ratio_min']:.3f}-{figures['time_ratio_max']:.3f})",
        figures["ms_median"],
        figures["rank_peak_over_mean"],
        figures["caching_ms_median"],
        "{:.3f} ({:.3f}-{:.3f})".format(*figures["caching_ratio"]),
        figures["faults_glibc"],
        figures["faults_caching"],
    ]


def _notes(seq_len: int, num_packs: int, hidden: int, rounds: int, rss: dict) -> str:
    """How the table was measured and how to read it."""
    return (
        f"Megatron GPTModel (local spec, 8 experts, top-2, hidden {hidden}, alltoall), EP=2 on 2 gloo "
        f"ranks, {num_packs} packs x {seq_len} tokens per rank from the embedded corpus, the second "
        "half of each pack padding; 'no padding' is the same packs' real tokens alone. Time: first "
        f"MoE layer forward + backward, {rounds} interleaved rounds (each variant following "
        "every other equally often), median of the per-round ratio to no padding (min-max), rank 0, "
        "CPU with the default allocator (fresh tensors each call). Rows summed over both "
        "ranks; EP-rank peak/mean of expert rows. constant "
        "and self route pads (--moe-pad-routing dispatch); skip is --moe-pad-routing skip on self pads. "
        "The router here is randomly initialised, and with 2 EP ranks whether constant pads, "
        "which crowd onto few experts, also overload one rank depends on where those experts "
        "sit: this column is not the pad hot-spot measurement (benchmarks hot_spot and "
        "router_hot_spot are, per expert and at EP=8/64 with a router fitted to text). "
        "Allocator columns: every variant also ran under the caching malloc setting every "
        "--cpu launch applies (glibc malloc keeping freed memory: mallopt M_MMAP_MAX 0, "
        "M_TRIM_THRESHOLD max; --no-cpu-caching-malloc turns it off), in the other half of a "
        "4-rank world (ranks 0-1 glibc's defaults, 2-3 caching, each half one EP=2 group), "
        "each (variant, allocator) pair once per round in a balanced order, one half at a "
        "time; 'caching/glibc' is the median of the per-round paired ratios of the whole MoE "
        "layer's forward + backward (min-max). What it saves is CPU page-fault cost (a fresh "
        "tensor above glibc's mmap threshold faults in every page on every step), which a "
        "GPU caching allocator never pays: it is no speed-up a GPU run would see. Peak RSS "
        f"per rank (ru_maxrss, whole process): glibc {rss['glibc']:.0f} MiB, caching "
        f"{rss['caching']:.0f} MiB."
    )
