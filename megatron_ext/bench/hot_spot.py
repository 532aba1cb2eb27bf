"""Benchmark: tokens received per expert-parallel rank and per expert when packs are half padding.

Runs Megatron's real tiny MoE GPTModel (8 experts, top-2, rope) at EP=2 on 2 gloo ranks. Each rank feeds
packs whose second half is padding, filled either with one constant id (what Megatron's GPTDataset does)
or with the pack's own tokens (megatron_ext's self-token padding), beside the same packs with no padding.
Reported: peak/mean tokens per EP rank and per expert (= per rank at EP = number of experts), worst layer.
"""

import numpy as np
import torch

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.testing import run_distributed

POLICIES = ("no padding", "constant id", "self tokens")


def _load_worker(seq_len: int, num_packs: int, pad_fraction: float) -> dict:
    from megatron.core import parallel_state

    from megatron_ext.data.padding import pad_pack
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics, peak_over_mean
    from megatron_ext.moe.router_observer import observe_routers
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.corpus import CONSTANT_PAD_ID, VOCAB_SIZE, corpus_stream

    rank = torch.distributed.get_rank()
    ep = parallel_state.get_expert_model_parallel_world_size()
    # The same weights on every rank except the experts (Megatron seeds those per EP rank).
    torch.manual_seed(0)
    model = build_tiny_gpt(tiny_moe_config(), vocab_size=VOCAB_SIZE, max_seq_len=seq_len)
    real_len = int(round(seq_len * (1 - pad_fraction)))
    out = {}
    for policy in POLICIES:
        rows = []
        for b in range(num_packs):
            text = corpus_stream((rank * num_packs + b) * seq_len, seq_len)
            if policy == "no padding":
                rows.append((text, np.arange(seq_len)))
                continue
            packed = pad_pack(
                text[:real_len],
                np.array([real_len]),
                seq_len,
                policy="constant" if policy == "constant id" else "self",
                pad_id=CONSTANT_PAD_ID,
            )
            rows.append((packed.tokens_S, packed.position_ids_S))
        tokens = torch.as_tensor(np.stack([r[0] for r in rows]))
        positions = torch.as_tensor(np.stack([r[1] for r in rows]))
        metrics = ExpertLoadMetrics(model.config.num_moe_experts, ep)
        with torch.no_grad(), observe_routers(model, metrics):
            model(tokens, positions, attention_mask=None)
        # Summed over the data-parallel ranks: together they route every token once.
        stats = metrics.device_stats(parallel_state.get_data_parallel_group())
        out[policy] = {
            "ep_rank_peak_over_mean": peak_over_mean(stats, "rank"),
            "expert_peak_over_mean": peak_over_mean(stats, "expert"),
            "per_rank": stats["rank_counts_LR"].tolist(),
            "per_expert": stats["tokens_LE"].tolist(),
        }
    return out


@register_benchmark("hot_spot")
def hot_spot(quick: bool) -> BenchResult:
    """Peak/mean load per EP rank and per expert at 50 % padding: constant id vs self vs no padding."""
    seq_len, num_packs = (128, 4) if quick else (256, 8)
    result = run_distributed(_load_worker, 2, seq_len, num_packs, 0.5, ep=2)[0]
    base = result["no padding"]
    rows = [
        [
            policy,
            result[policy]["ep_rank_peak_over_mean"],
            result[policy]["ep_rank_peak_over_mean"] / base["ep_rank_peak_over_mean"],
            result[policy]["expert_peak_over_mean"],
            result[policy]["expert_peak_over_mean"] / base["expert_peak_over_mean"],
        ]
        for policy in POLICIES
    ]
    return BenchResult(
        title="Pad hot spot: tokens received per EP rank and per expert (50 % padding)",
        columns=[
            "pads filled with",
            "EP=2 rank peak/mean",
            "vs no padding",
            "per-expert peak/mean",
            "vs no padding",
        ],
        rows=rows,
        notes=(
            f"Megatron GPTModel (local spec, rope, 2 MoE layers, 8 experts, top-2, random init), EP=2 on "
            f"2 gloo ranks, {num_packs} packs x {seq_len} tokens per rank from the embedded corpus, half of "
            "each pack padding; worst layer. 'per-expert' equals per-rank load at EP=8."
        ),
        extra=result,
    )
