"""The CPU main job (``make demo`` / ``megatron-ext demo``): megatron_ext inside Megatron's real training loop.

It preprocesses the embedded corpus with ``tools/preprocess_data.py`` and runs the launch of
``examples/cpu_demo.sh`` (the checkout's, or the copies an installed wheel ships:
:mod:`megatron_ext.common.shipped_files`; ``megatron_ext.pretrain_gpt --cpu ...``: ``megatron.training.pretrain``
on 2 gloo ranks, a tiny MoE HybridModel, EP=2, rollout-style rows that are mostly padding) four times, as
``megatron-ext rehearse`` runs configurations (the example's flags, ranks forked from one server that
imported Megatron once):

1. ``--pad-policy constant --moe-pad-routing dispatch``: pads are one id (0), as most packers do, and are
   routed like text;
2. ``--pad-policy self --moe-pad-routing dispatch --route-replay-mode record``: pads are the row's own
   tokens; the routes Megatron chose are written as a route sidecar beside the tokens;
3. ``--moe-pad-routing skip``: self pads that reach no expert (what ``auto`` chooses for this run);
4. ``--route-replay-mode replay --route-replay-check`` from other initial weights, at context
   parallelism 1: every MoE layer replays the routes recorded at CP 2, and the loop counts how many
   it used exactly.

Then one RL step, the log-prob agreement route replay exists for (context parallelism 1, one
iteration each, stand-in advantages of +1/-1 per document): a ``record`` pass writes routes and
behaviour log-probs (``--rl-record-logprobs``) with Megatron's router input jitter
(``--moe-input-jitter-eps 0.01``, standing in for the inference engine's other numerics); then
``--rl-loss ppo`` of the same initial weights with the recorded routes replayed, and without. The
loop's ``rl/logprob_mismatch`` (mean |trainer - behaviour log-prob| over trained tokens) is
compared.

Runs 1-3 are long-context runs in miniature: ``--context-parallel-size 2`` (data-parallel size 1, EP 2
over the same ranks), every pack split per document over the 2 CP ranks by Megatron's own
``get_batch_on_this_cp_rank``, each document padded to a multiple of 4 (its own tokens, or the
constant id in run 1) before the pack's tail.

Everything it reports comes from what the loop logged: the ``lm loss`` and ``rl/*`` lines, the expert-load JSON lines
(``--moe-expert-load-log``), the replay check lines and the fp8 rehearsal's group report.

    megatron-ext demo [--steps 6] [--json out/demo.json] [--png out/demo_load.png] [--workdir DIR]

Exit status 1 if a check fails.
"""

import argparse
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from megatron_ext.common.safe_files import atomic_write_bytes
from megatron_ext.common.shipped_files import PACKAGE, shipped_file
from megatron_ext.rehearse import rank_server as preloaded
from megatron_ext.rehearse.local_launch import LoopRun, launch
from megatron_ext.rehearse.matrix import example_flags

EP = 2
#: Runs 1-3 split every pack over this many context-parallel ranks; the replay run over 1.
DEMO_CP = 2
#: The loop logs lm loss to 7 significant digits. Pads never reach a real token's loss (masked, own
#: attention segment, out of the aux loss), but they change how many rows each expert's grouped GEMM
#: sums over, so fp32 rounding of the same real-token products differs in the last bits; over a few
#: Adam steps that shows as at most one unit of the 7th digit (measured 1e-6 at step 6). A leak of
#: pads into real tokens moves the loss by orders of magnitude more.
LOSS_TOLERANCE = 5e-6
#: The RL step's behaviour pass: Megatron's router input jitter, uniform(1 - eps, 1 + eps).
RL_JITTER_EPS = "0.01"
#: Replay must cut the trainer/behaviour mismatch at least this much: the route flips the jitter
#: causes dominate it without replay (seen 26x in tests/training/test_real_loop_policy_loss.py).
RL_MISMATCH_FACTOR = 5.0
TRAINING_LOOP = "megatron.training.pretrain"
_REPLAY = re.compile(
    r"replay check: (\d+) \(token, layer\) rows with a recorded route, (\d+) used exactly;"
    r".*differently on (\d+) of"
)
_REHEARSAL = re.compile(
    r"rank (\d+) rehearsal: (\d+) expert groups .*?, (\d+) not a multiple of (\d+); last: (\[[^\]]*\])"
)


def _launch(flags: list[str], data: str, log_name: str, workdir: Path) -> LoopRun:
    """The example's launch with ``flags`` last, as ``megatron-ext rehearse`` runs a configuration:
    the flags ``examples/cpu_demo.sh`` passes, on ranks forked from one preloaded server."""
    env = {**os.environ, "DATA": str(Path(data).parent), "NPROC": str(EP)}
    args = example_flags(shipped_file("examples", "cpu_demo.sh"), env, flags)
    run = launch(args, nproc=EP, timeout=1800, cwd=workdir)
    (workdir / f"{log_name}.log").write_text(run.output)
    if run.returncode != 0:
        tail = "\n".join(run.output.splitlines()[-40:])
        raise RuntimeError(f"demo run '{log_name}' failed ({run.returncode}):\n{tail}")
    return run


def _context_parallel_size(output: str) -> int | None:
    """The context-parallel size Megatron initialised, from its ``using world size: ...`` line."""
    found = re.search(r"context-parallel size: (\d+)", output)
    return int(found.group(1)) if found else None


def _load_counts(path: Path) -> dict[str, np.ndarray]:
    """Tokens per expert summed over every logged iteration: ``{"all"|"real": [layers, experts]}``."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [line for line in lines if "replay_check" not in line]  # the replay check's lines
    layers = sorted({k.split("/")[0] for line in lines for k in line if k.startswith("layer")})
    out = {}
    for kind, key in (("all", "tokens"), ("real", "real_tokens")):
        out[kind] = np.array(
            [np.sum([line[f"{layer}/{key}"] for line in lines], axis=0) for layer in layers]
        )
    out["iterations"] = np.array([line["iteration"] for line in lines])
    for key in ("tokens_per_s", "real_tokens_per_s", "pad_fraction"):  # the loop's throughput line
        out[key] = np.array([line[key] for line in lines])
    return out


def _peak_over_mean(counts_LE: np.ndarray, groups: int) -> float:
    """max/mean of tokens received per group of experts (EP rank), worst layer."""
    per_group = counts_LE.reshape(counts_LE.shape[0], groups, -1).sum(-1)
    return float((per_group.max(-1) / per_group.mean(-1)).max())


def summarize(runs: dict[str, LoopRun], loads: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """The JSON summary and its checks, from what the runs logged."""
    constant, self_pad, skip = runs["constant"], runs["self"], runs["skip"]
    iterations = sorted(self_pad.losses)
    losses_c = [constant.losses[i] for i in iterations]
    losses_s = [self_pad.losses[i] for i in iterations]
    losses_k = [skip.losses[i] for i in iterations]
    diff = float(np.max(np.abs(np.subtract(losses_c, losses_s))))
    step_ms = {  # the first iteration includes warm-up (allocations, gloo buffers)
        name: float(
            np.median(
                [run.iterations[i]["elapsed time per iteration (ms)"] for i in iterations[1:]]
            )
        )
        for name, run in (("self", self_pad), ("skip", skip))
    }
    groups = _rehearsal_groups([constant, self_pad])
    summary = {
        "training_loop": TRAINING_LOOP,
        "iterations": len(iterations),
        # Equal to LOSS_TOLERANCE: see its comment for why not bitwise.
        "loss_equal": diff <= LOSS_TOLERANCE,
        "loss_bitwise_equal_steps": sum(a == b for a, b in zip(losses_c, losses_s, strict=True)),
        "loss_max_abs_diff": diff,
        "losses_constant": losses_c,
        "losses_self": losses_s,
        **_load_figures(loads),
        **_replay_figures(runs),
        "alignment_ok": bool(groups)
        and all(g["groups"] > 0 and g["unaligned"] == 0 for g in groups.values()),
        "alignment_groups": [groups[r]["last"] for r in sorted(groups)],
        "alignment_multiple": sorted({g["align"] for g in groups.values()}),
        "skip_step_time_vs_self": step_ms["skip"] / step_ms["self"],
        "skip_loss_max_abs_diff": float(np.max(np.abs(np.subtract(losses_k, losses_s)))),
        "throughput": _throughput(loads),
        "rl_step": _rl_step(runs),
    }
    summary["checks"] = _checks(summary, loads, losses_s)
    return summary


def _load_figures(loads: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """The pad runs' expert load: pad fraction, peak/mean per EP rank and per expert, rows."""
    load_c, load_s, load_k = loads["constant"], loads["self"], loads["skip"]
    experts = load_s["all"].shape[1]
    figures: dict[str, Any] = {
        "pad_fraction": float(1 - load_s["real"].sum() / load_s["all"].sum())
    }
    for name, counts in (
        ("constant", load_c["all"]),
        ("self", load_s["all"]),
        ("nopad", load_s["real"]),
    ):
        figures[f"peak_over_mean_{name}"] = _peak_over_mean(counts, EP)
        figures[f"expert_peak_over_mean_{name}"] = _peak_over_mean(counts, experts)
    figures["skip_expert_rows"] = int(load_k["all"].sum())
    figures["self_expert_rows"] = int(load_s["all"].sum())
    figures["tokens_per_expert"] = {
        "constant": load_c["all"].tolist(),
        "self": load_s["all"].tolist(),
        "nopad": load_s["real"].tolist(),
    }
    return figures


def _replay_figures(runs: dict[str, LoopRun]) -> dict[str, Any]:
    """The replay run's check lines summed, and the CP sizes Megatron initialised (its own log
    lines, not as asked)."""
    replay = runs["replay"]
    # Per logged iteration: (rows with a recorded route, used exactly, the router would differ).
    matched = [tuple(map(int, m)) for m in _REPLAY.findall(replay.output)]
    rows = sum(r for r, _, _ in matched)
    return {
        "replay_rows": rows,
        "replay_context_parallel": _context_parallel_size(replay.output),
        "context_parallel": _context_parallel_size(runs["self"].output),
        "replay_match_rate": sum(m for _, m, _ in matched) / max(rows, 1),
        "natural_routing_changed": sum(d for _, _, d in matched) / max(rows, 1),
    }


def _rl_step(runs: dict[str, LoopRun]) -> dict[str, float]:
    """The RL step's metrics as the loop logged them (its one iteration), with and without replay."""
    out = {}
    for name in ("rl_replay", "rl_native"):
        step = runs[name].iterations[1]
        out |= {f"{name}_{key.split('/')[1]}": step[key] for key in sorted(step) if "rl/" in key}
    return out


def _throughput(loads: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, float]]:
    """Tokens and real (non-pad) tokens per second as the loop logged them, median of the
    iterations after the first (warm-up), and the pad fraction, per pad run."""
    return {
        name: {
            key: float(np.median(loads[name][key][1:]))
            for key in ("tokens_per_s", "real_tokens_per_s")
        }
        | {"pad_fraction": float(loads[name]["pad_fraction"].mean())}
        for name in ("constant", "self", "skip")
    }


def _rehearsal_groups(runs: list[LoopRun]) -> dict[int, dict[str, Any]]:
    """Per rank, the fp8 rehearsal's expert groups over ``runs``: how many reached the grouped
    GEMM, how many were not aligned, the multiple and the last groups (from the rank's lines)."""
    groups: dict[int, dict[str, Any]] = {}
    for run in runs:
        for rank, n, bad, align, last in _REHEARSAL.findall(run.output):
            entry = groups.setdefault(int(rank), {"groups": 0, "unaligned": 0, "last": None})
            entry["groups"] += int(n)
            entry["unaligned"] += int(bad)
            entry["align"], entry["last"] = int(align), json.loads(last)
    return groups


def _checks(
    summary: dict[str, Any], loads: dict[str, dict[str, np.ndarray]], losses_s: list[float]
) -> dict[str, bool]:
    """The demo's checks, each from what the runs logged (the summary's figures)."""
    load_c, load_s, load_k = loads["constant"], loads["self"], loads["skip"]
    # Per expert (= per EP rank at EP=8): whether constant pads also overload one of only 2 EP
    # ranks depends on whether the experts they all take share a rank; per expert they always do.
    nopad = summary["expert_peak_over_mean_nopad"]
    gap_constant = summary["expert_peak_over_mean_constant"] - nopad
    gap_self = abs(summary["expert_peak_over_mean_self"] - nopad)
    return {
        "the real loop trained: loss falls": losses_s[-1] < losses_s[0],
        "loss equal under both pad policies": summary["loss_equal"],
        "real tokens route identically under both pad policies": bool(
            np.array_equal(load_c["real"], load_s["real"])
        ),
        "self padding keeps per-expert load closer to no padding than constant padding": gap_self
        < gap_constant,
        "skip: experts receive exactly the real tokens' rows, loss unchanged": bool(
            np.array_equal(load_k["all"], load_s["real"])
        )
        and summary["skip_loss_max_abs_diff"] <= LOSS_TOLERANCE,
        f"replay at context parallelism 1 reproduces every route recorded at {DEMO_CP}": (
            summary["replay_rows"] > 0
            and summary["replay_match_rate"] == 1.0
            and summary["natural_routing_changed"] > 0
            and summary["replay_context_parallel"] == 1
            and summary["context_parallel"] == DEMO_CP
        ),
        "RL step: replay cuts the trainer/behaviour log-prob mismatch "
        f"{RL_MISMATCH_FACTOR:.0f}x or more": _rl_ok(summary["rl_step"]),
        "fp8 rehearsal: every expert group reached the grouped GEMM aligned to 16": summary[
            "alignment_ok"
        ]
        and summary["alignment_multiple"] == [16],
    }


def _rl_ok(rl: dict[str, float]) -> bool:
    """Replay moved the trainer's log-probs toward the behaviour ones (and the jitter did act)."""
    replayed, native = rl["rl_replay_logprob_mismatch"], rl["rl_native_logprob_mismatch"]
    return 0 < replayed and RL_MISMATCH_FACTOR * replayed <= native


def report(summary: dict[str, Any], seconds: float) -> str:
    """The human-readable report."""
    lines = [
        f"Megatron's training loop ({TRAINING_LOOP}), {summary['iterations']} iterations per run, "
        f"EP={EP} over 2 gloo processes; rows {summary['pad_fraction']:.0%} padding; pad runs at "
        f"context parallelism {summary['context_parallel']} (every pack split per document over "
        "the CP ranks, each document padded to a multiple of 2*CP)",
        "loss per step (real tokens only, as the loop logged it):",
        "  constant pads: " + " ".join(f"{v:.6f}" for v in summary["losses_constant"]),
        "  self pads:     " + " ".join(f"{v:.6f}" for v in summary["losses_self"]),
        f"  max |difference| {summary['loss_max_abs_diff']:.1e} (equal within {LOSS_TOLERANCE:.0e}: "
        f"{summary['loss_equal']}; bitwise in {summary['loss_bitwise_equal_steps']} of "
        f"{summary['iterations']} steps)",
        "tokens received, peak/mean over EP=2 ranks (worst layer) | per expert:",
    ]
    for label, key in (
        ("no padding*", "nopad"),
        ("constant pads", "constant"),
        ("self pads", "self"),
    ):
        lines.append(
            f"  {label:<14} {summary[f'peak_over_mean_{key}']:.3f} | "
            f"{summary[f'expert_peak_over_mean_{key}']:.3f}"
        )
    lines += [
        "  * the same rows' real tokens only (their routing is identical under both policies)",
        f"skip pads (--moe-pad-routing skip): expert rows {summary['skip_expert_rows']} vs "
        f"{summary['self_expert_rows']} with self pads routed "
        f"({summary['skip_expert_rows'] / summary['self_expert_rows'] - 1:+.0%}), step time "
        f"{summary['skip_step_time_vs_self']:.2f}x self pads (median of iterations 2-"
        f"{summary['iterations']}, whole step)",
        "tokens/s as logged (median of iterations 2-"
        f"{summary['iterations']}): "
        + ", ".join(
            f"{name} pads {t['tokens_per_s']:.0f} ({t['real_tokens_per_s']:.0f} real)"
            for name, t in summary["throughput"].items()
        ),
        f"route replay at context parallelism {summary['replay_context_parallel']} (recorded at "
        f"{summary['context_parallel']}): "
        f"{summary['replay_match_rate']:.1%} of {summary['replay_rows']} (token, layer) "
        "routes used exactly as recorded; the replaying model's own router would have chosen "
        f"differently on {summary['natural_routing_changed']:.1%}",
        "RL step (--rl-loss ppo, behaviour log-probs recorded with --moe-input-jitter-eps "
        f"{RL_JITTER_EPS}): mean |trainer - behaviour log-prob| "
        f"{summary['rl_step']['rl_replay_logprob_mismatch']:.1e} with route replay, "
        f"{summary['rl_step']['rl_native_logprob_mismatch']:.1e} without; clip fraction "
        f"{summary['rl_step']['rl_replay_clip_fraction']:.3f} / "
        f"{summary['rl_step']['rl_native_clip_fraction']:.3f}",
        f"fp8 rehearsal: last expert groups per rank {summary['alignment_groups']} -> all "
        f"multiples of {summary['alignment_multiple']}: {summary['alignment_ok']}",
        f"wall time {seconds:.1f} s",
        "checks:",
    ]
    lines += [f"  [{'ok' if ok else 'FAILED'}] {name}" for name, ok in summary["checks"].items()]
    return "\n".join(lines)


def plot_load(summary: dict[str, Any], path: str) -> None:
    """PNG: tokens per expert, constant vs self pads vs none, in the layer constant pads hit most."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = summary["tokens_per_expert"]
    series = {
        "no padding (real tokens only)": np.array(counts["nopad"]),
        "constant pads": np.array(counts["constant"]),
        "self pads": np.array(counts["self"]),
    }
    constant = series["constant pads"]
    layer = int(np.argmax(constant.max(-1) / constant.mean(-1)))
    experts = np.arange(constant.shape[1])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for offset, (label, values) in zip((-0.27, 0.0, 0.27), series.items(), strict=True):
        ax.bar(experts + offset, values[layer], width=0.27, label=label)
    half = constant.shape[1] // EP
    ax.set_xlabel(f"expert (0-{half - 1} on EP rank 0, {half}-{2 * half - 1} on EP rank 1)")
    ax.set_ylabel(f"token slots, MoE layer {layer + 1}")
    ax.set_title(f"Per-expert load at {summary['pad_fraction']:.0%} padding (Megatron's loop)")
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())  # written whole, or not at all


def run_demo(steps: int, workdir: Path) -> tuple[dict[str, LoopRun], dict[str, Any]]:
    """Preprocesses the corpus and runs the four launches and the RL step in ``workdir``; returns runs and loads."""
    prefix = str(workdir / "corpus_text_document")
    corpus = PACKAGE / "assets" / "corpus.jsonl"
    tool = shipped_file("tools", "preprocess_data.py")
    preloaded.warm_up()  # the launch server imports Megatron while the corpus is preprocessed
    subprocess.run(
        [sys.executable, str(tool), "--input", str(corpus), "--output-prefix", prefix,
         "--append-eod"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    common = ["--train-iters", str(steps)]
    cp = ["--context-parallel-size", str(DEMO_CP)]
    runs, loads = {}, {}
    for name, flags in (
        ("constant", ["--pad-policy", "constant", "--moe-pad-routing", "dispatch"]),
        ("self", ["--moe-pad-routing", "dispatch", "--route-replay-mode", "record",
                  "--route-record-path", prefix + "_routes"]),
        ("skip", ["--moe-pad-routing", "skip"]),
    ):  # fmt: skip
        log = workdir / f"load_{name}.jsonl"
        print(f"  run '{name}' ...", flush=True)
        runs[name] = _launch(
            [*common, *cp, *flags, "--moe-expert-load-log", str(log)], prefix, name, workdir
        )
        loads[name] = _load_counts(log)
    print("  run 'replay' (other initial weights, context parallelism 1) ...", flush=True)
    runs["replay"] = _launch(
        [*common, "--route-replay-mode", "replay", "--route-data-suffix", "_routes",
         "--route-replay-check", "--init-method-std", "0.05"],
        prefix, "replay", workdir,
    )  # fmt: skip
    runs |= _rl_step_runs(prefix, workdir)
    return runs, loads


def _rl_step_runs(prefix: str, workdir: Path) -> dict[str, LoopRun]:
    """The RL step's three one-iteration launches (module docstring), at context parallelism 1
    (the policy loss refuses more)."""
    _write_stand_in_advantages(prefix)
    rl = ["--train-iters", "1", "--rl-loss", "ppo", "--calculate-per-token-loss"]
    runs = {}
    for name, flags in (
        ("rl_record", ["--train-iters", "1", "--route-replay-mode", "record",
                       "--route-record-path", prefix + "_rl_routes",
                       "--rl-record-logprobs", prefix + "_logprobs",
                       "--moe-input-jitter-eps", RL_JITTER_EPS]),
        ("rl_replay", [*rl, "--route-replay-mode", "replay", "--route-data-suffix", "_rl_routes"]),
        ("rl_native", rl),
    ):  # fmt: skip
        print(f"  run '{name}' ...", flush=True)
        runs[name] = _launch(flags, prefix, name, workdir)
    return runs


def _write_stand_in_advantages(prefix: str) -> None:
    """``prefix_advantages``: +1 on every token of even documents, -1 on odd ones (a stand-in for
    a reward model's group-normalised rewards), with the header naming the tokens' digest."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.indexed_writer import write_token_sidecar

    tokens = IndexedDataset(prefix)  # its index is a memory map: copy before it is closed
    lengths = tokens.sequence_lengths.copy()
    del tokens
    values = [np.full(n, 1.0 if d % 2 == 0 else -1.0, np.float32) for d, n in enumerate(lengths)]
    write_token_sidecar(
        prefix + "_advantages", values, prefix, lengths, name="advantages", scope="sequence"
    )


def main(args: argparse.Namespace) -> int:
    """Runs the demo; exit status 1 if a check fails."""
    from megatron_ext.common.safe_files import check_output_file

    png = args.png or "out/demo_load.png"
    # megatron-ext demo's own parser (not Megatron's) sets it; a caller's namespace may omit it.
    overwrite = getattr(args, "overwrite", False)
    if args.steps < 2:  # the step-time median and "loss falls" compare iterations 2.. with 1
        print(f"megatron-ext demo: --steps must be at least 2, got {args.steps}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("matplotlib") is None:  # the plot comes last: say so first
        print(
            "megatron-ext demo: the per-expert load plot (--png) needs matplotlib, which is not "
            "installed: pip install 'megatron_ext[tools]'",
            file=sys.stderr,
        )
        return 2
    keep = args.workdir
    if keep and os.path.exists(keep) and not os.path.isdir(keep):
        print(f"megatron-ext demo: --workdir {keep} is a file, not a directory", file=sys.stderr)
        return 2
    for flag, path in (("--png", png), ("--json", args.json)):
        if path:  # checked before minutes of training, not after
            check_output_file(path, flag=flag, overwrite=overwrite)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(
        f"megatron_ext demo: {TRAINING_LOOP} on CPU (--cpu), tiny MoE HybridModel, EP={EP}, "
        "2 gloo processes, 4 runs and an RL step (examples/cpu_demo.sh) ...",
        flush=True,
    )
    workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="megatron_ext_demo_"))
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        print(f"megatron-ext demo: --workdir {workdir} is not empty", file=sys.stderr)
        return 2
    try:
        runs, loads = run_demo(args.steps, workdir)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - start
    summary = summarize(runs, loads)
    summary["wall_seconds"] = seconds
    print(report(summary, seconds))
    plot_load(summary, png)
    print(f"per-expert load plot: {png}")
    if args.json:
        atomic_write_bytes(args.json, json.dumps(summary, indent=2).encode())
        print(f"summary: {args.json}")
    return 0 if all(summary["checks"].values()) else 1
