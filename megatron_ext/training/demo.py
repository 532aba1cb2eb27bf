"""The CPU main job (``make demo`` / ``megatron-ext demo``): what megatron_ext does, on a laptop-sized machine.

Two gloo processes, EP=2, Megatron's real tiny MoE GPTModel with megatron_ext's MoE layer, on the embedded
corpus (byte-level tokens, no download). Rollout rows are at least half padding. It trains under
``constant`` then ``self`` padding from the same initial weights, records and replays routes, and runs the
fp8 alignment path; then prints a report, checks it, and writes a PNG of per-expert load and a JSON summary.

    megatron-ext demo [--steps 4] [--json out/demo.json] [--png out/demo_load.png]

Exit status 1 if a check fails: real-token loss differs between pad policies (beyond the fp32 tolerance
below), self padding is not closer to the no-padding load than constant padding, replay reproduces less than
every route, or an fp8 expert group reaches the GEMM unaligned.
"""

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.testing import run_distributed

EP = 2
BATCH, SEQ_LEN = 4, 256
#: fp32 throughout; the two policies give experts different row counts (pads differ), which may only change
#: summation order inside the expert GEMMs, so trajectories agree to rounding, far below this bound.
LOSS_TOLERANCE = 1e-5


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON summary and the checks, from the worker's raw result."""
    constant, self_pad = result["constant"], result["self"]
    none = {  # the real tokens of the same rows: what the batch would route without padding
        "ep_rank_peak_over_mean": self_pad["real_ep_rank_peak_over_mean"],
        "expert_peak_over_mean": self_pad["real_expert_peak_over_mean"],
        "ep_rank_max_vio": self_pad["real_ep_rank_max_vio"],
    }
    loss_diff = float(np.max(np.abs(np.subtract(constant["losses"], self_pad["losses"]))))
    summary = {
        "loss_equal": loss_diff <= LOSS_TOLERANCE,
        "loss_max_abs_diff": loss_diff,
        "losses_constant": constant["losses"],
        "losses_self": self_pad["losses"],
        "pad_fraction": self_pad["pad_fraction"],
        "peak_over_mean_constant": constant["ep_rank_peak_over_mean"],
        "peak_over_mean_self": self_pad["ep_rank_peak_over_mean"],
        "peak_over_mean_nopad": none["ep_rank_peak_over_mean"],
        "max_vio_constant": max(constant["ep_rank_max_vio"]),
        "max_vio_self": max(self_pad["ep_rank_max_vio"]),
        "max_vio_nopad": max(none["ep_rank_max_vio"]),
        "expert_peak_over_mean_constant": constant["expert_peak_over_mean"],
        "expert_peak_over_mean_self": self_pad["expert_peak_over_mean"],
        "expert_peak_over_mean_nopad": none["expert_peak_over_mean"],
        "replay_match_rate": result["replay"]["replay_match_rate"],
        "natural_routing_changed": result["replay"]["natural_routing_changed"],
        "route_dtype": result["replay"]["route_dtype"],
        "alignment_ok": result["alignment"]["aligned"],
        "alignment_groups": result["alignment"]["groups"],
    }
    gap_constant = summary["peak_over_mean_constant"] - summary["peak_over_mean_nopad"]
    gap_self = abs(summary["peak_over_mean_self"] - summary["peak_over_mean_nopad"])
    summary["checks"] = {
        "loss identical under both pad policies": summary["loss_equal"],
        "real tokens route identically under both pad policies": constant["real_tokens_per_expert"]
        == self_pad["real_tokens_per_expert"],
        "self padding keeps EP-rank load near no padding": gap_self < gap_constant,
        "replay reproduces every recorded route": summary["replay_match_rate"] == 1.0
        and summary["natural_routing_changed"] > 0,
        "fp8 expert groups aligned to 16": summary["alignment_ok"],
    }
    return summary


def report(summary: dict[str, Any], seconds: float) -> str:
    """The human-readable report."""
    lines = [
        f"rollout rows: {BATCH} per rank x {SEQ_LEN} tokens, {summary['pad_fraction']:.0%} padding",
        "loss per step (real tokens only):",
        "  constant pads: " + " ".join(f"{v:.5f}" for v in summary["losses_constant"]),
        "  self pads:     " + " ".join(f"{v:.5f}" for v in summary["losses_self"]),
        f"  max |difference| {summary['loss_max_abs_diff']:.2e}  "
        f"(identical: {summary['loss_equal']})",
        "tokens received, peak/mean over EP=2 ranks (worst layer) | max_vio | per expert (EP=8):",
    ]
    for label, key in (
        ("no padding*", "nopad"),
        ("constant pads", "constant"),
        ("self pads", "self"),
    ):
        lines.append(
            f"  {label:<14} {summary[f'peak_over_mean_{key}']:.3f} | "
            f"{summary[f'max_vio_{key}']:.3f} | {summary[f'expert_peak_over_mean_{key}']:.3f}"
        )
    lines += [
        "  * the same rows' real tokens only (their routing is identical under both policies)",
        f"route replay: {summary['replay_match_rate']:.1%} of (token, layer) top-k reproduced after "
        f"perturbing the routers changed {summary['natural_routing_changed']:.1%} of natural routes "
        f"(routes stored as {summary['route_dtype']})",
        f"fp8 alignment: expert groups reaching the grouped GEMM {summary['alignment_groups']} "
        f"-> all multiples of 16: {summary['alignment_ok']}",
        f"wall time {seconds:.1f} s",
        "checks:",
    ]
    lines += [f"  [{'ok' if ok else 'FAILED'}] {name}" for name, ok in summary["checks"].items()]
    return "\n".join(lines)


def plot_load(result: dict[str, Any], path: str) -> None:
    """PNG: tokens per expert under constant vs self padding vs none (the layer constant pads hit most)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "no padding (real tokens only)": result["self"]["real_tokens_per_expert"],
        "constant pads": result["constant"]["tokens_per_expert"],
        "self pads": result["self"]["tokens_per_expert"],
    }
    layer = int(np.argmax([np.max(c) / np.mean(c) for c in series["constant pads"]]))
    experts = np.arange(len(series["constant pads"][layer]))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for offset, (label, counts) in zip((-0.27, 0.0, 0.27), series.items(), strict=True):
        ax.bar(experts + offset, counts[layer], width=0.27, label=label)
    ax.set_xlabel("expert (experts 0-3 on EP rank 0, 4-7 on EP rank 1)")
    ax.set_ylabel(f"token slots routed, MoE layer {layer + 1}")
    ax.set_title("Per-expert load at 50 %+ padding: constant id vs self tokens")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """Runs the demo; exit status 1 if a check fails."""
    from megatron_ext.training.demo_worker import demo_worker

    start = time.perf_counter()
    print(f"megatron_ext demo: tiny MoE GPTModel, EP={EP}, 2 gloo processes on CPU ...", flush=True)
    result = run_distributed(demo_worker, 2, args.steps, BATCH, SEQ_LEN, ep=EP, timeout=600)[0]
    seconds = time.perf_counter() - start
    summary = summarize(result)
    summary["wall_seconds"] = seconds
    print(report(summary, seconds))
    png = getattr(args, "png", None) or "out/demo_load.png"
    plot_load(result, png)
    print(f"per-expert load plot: {png}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**summary, "raw": result}, indent=2))
        print(f"summary: {args.json}")
    return 0 if all(summary["checks"].values()) else 1
