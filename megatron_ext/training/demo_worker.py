"""The per-rank work of the CPU main job (``megatron-ext demo``); runs inside ``run_distributed``.

Three parts, all on Megatron's real tiny MoE GPTModel at EP=2 (alltoall dispatcher, megatron_ext's MoE
layer spec with expert-load metrics):

1. Pad policies: the same rollout rows (one corpus document per row, self- or constant-padded to seq_len,
   half or more of each row padding) train two identically initialised models for a few steps: real-token
   loss must match, while per-EP-rank load differs.
   The no-padding baseline is the real tokens' share of the same runs (the same text without its pads).
2. Route record -> replay: routes recorded by one forward, router weights perturbed (natural routing
   changes), replayed: the fraction of (token, layer) top-k sets reproduced.
3. Alignment: an fp8 run of the same layer with grouped-GEMM experts; every expert group that reaches the
   GEMM must be a multiple of 16 (the torch._grouped_mm backend raises otherwise).
"""

import time
from typing import Any

import numpy as np
import torch

EP = 2


def _build(seed: int, *, grouped_mm: bool = False, align: bool = False):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.config import MoEAlignmentConfig
    from megatron_ext.moe.layer_specs import get_aligned_gpt_layer_local_spec
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.corpus import VOCAB_SIZE

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed, force_reset_rng=True
    )  # identical init, experts per EP rank
    config = tiny_moe_config()
    metrics = ExpertLoadMetrics(config.num_moe_experts, EP)
    alignment = MoEAlignmentConfig(moe_dispatch_align=align, moe_expert_load_metrics=True)
    spec = get_aligned_gpt_layer_local_spec(
        alignment, config.num_moe_experts, grouped_mm=grouped_mm, load_metrics=metrics
    )
    model = build_tiny_gpt(config, vocab_size=VOCAB_SIZE, max_seq_len=256, layer_spec=spec)
    return model, metrics, config


def _rows(step: int, rank: int, batch: int, seq_len: int, policy: str) -> dict[str, torch.Tensor]:
    """Rollout rows: corpus documents, one per row, cut at seq_len and padded to it."""
    from megatron_ext.data.padding import pad_pack
    from megatron_ext.training.corpus import CONSTANT_PAD_ID, corpus_documents

    docs = corpus_documents()
    packs = []
    for b in range(batch):
        doc = docs[(step * 2 + rank) * batch + b][: seq_len // 2]  # at least half of each row pads
        packs.append(
            pad_pack(doc, np.array([doc.size]), seq_len, policy=policy, pad_id=CONSTANT_PAD_ID)
        )
    return {
        "tokens": torch.as_tensor(np.stack([p.tokens_S for p in packs])),
        "labels": torch.as_tensor(np.stack([p.labels_S for p in packs])),
        "loss_mask": torch.as_tensor(np.stack([p.loss_mask_S for p in packs])),
        "position_ids": torch.as_tensor(np.stack([p.position_ids_S for p in packs])),
        "padding_mask": torch.as_tensor(np.stack([p.pad_mask_S for p in packs])),
        "cu_seqlens": torch.as_tensor(np.stack([p.cu_seqlens for p in packs])),
    }


def _loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron_ext.data.batch import gpt_forward_kwargs, masked_mean_loss

    per_token = model(**gpt_forward_kwargs(batch, layout="mask"))
    return masked_mean_loss(per_token, batch["loss_mask"]), per_token


def train_policy(policy: str, steps: int, batch: int, seq_len: int) -> dict[str, Any]:
    """Trains a fresh model on rows padded under ``policy``; losses and load per step."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_ext.moe.load_metrics import peak_over_mean

    rank = torch.distributed.get_rank()
    model, metrics, config = _build(seed=1)
    # Megatron's own DDP reduces the gradients (dense over DP, experts over expert-DP, both 1/DP).
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp = parallel_state.get_data_parallel_group()
    losses, pad_fraction = [], []
    for step in range(steps):
        rows = _rows(step, rank, batch, seq_len, policy)
        pad_fraction.append(float(rows["padding_mask"].float().mean()))
        model.zero_grad_buffer()
        loss, _ = _loss(model, rows)
        loss.backward()
        model.finish_grad_sync()
        for param in model.parameters():  # torch.optim reads .grad; Megatron's DDP fills .main_grad
            param.grad = param.main_grad
        optimizer.step()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss, group=dp)
        losses.append(float(global_loss) / torch.distributed.get_world_size(dp))
    stats = metrics.device_stats(dp)
    return {
        "losses": losses,
        "pad_fraction": float(np.mean(pad_fraction)),
        "tokens_per_expert": stats["tokens_LE"].tolist(),
        "tokens_per_ep_rank": stats["rank_counts_LR"].tolist(),
        "ep_rank_max_vio": stats["rank_max_vio"].tolist(),
        # Real tokens only: the same text without its padding (the no-padding baseline).
        "real_tokens_per_expert": stats["real_tokens_LE"].tolist(),
        "real_tokens_per_ep_rank": stats["real_rank_counts_LR"].tolist(),
        "real_ep_rank_max_vio": stats["real_rank_max_vio"].tolist(),
        "ep_rank_peak_over_mean": peak_over_mean(stats, "rank"),
        "expert_peak_over_mean": peak_over_mean(stats, "expert"),
        "real_ep_rank_peak_over_mean": peak_over_mean(stats, "rank", "real_"),
        "real_expert_peak_over_mean": peak_over_mean(stats, "expert", "real_"),
    }


def record_and_replay(batch: int, seq_len: int) -> dict[str, Any]:
    """Records routes, perturbs the routers, replays: match rate of replayed vs recorded top-k."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.replay.binding import RouteReplayBinding

    model, _, _ = _build(seed=2)
    rows = _rows(0, torch.distributed.get_rank(), batch, seq_len, "self")
    chosen: list[torch.Tensor] = []
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.register_forward_hook(lambda m, i, o: chosen.append(o[1].detach()))

    recorder = RouteReplayBinding(model, "record")
    recorder.begin_record("demo", batch, seq_len)
    with torch.no_grad():
        _loss(model, rows)
    routes_BSLK = recorder.recorded_routes("demo")
    recorded_maps = list(chosen)
    recorder.remove()

    with torch.no_grad():
        for router in routers:
            router.weight.add_(torch.randn_like(router.weight) * router.weight.std() * 2)
    chosen.clear()
    with torch.no_grad():
        _loss(model, rows)
    natural_changed = float(
        np.mean(
            [
                (a != b).any(-1).float().mean().item()
                for a, b in zip(chosen, recorded_maps, strict=True)
            ]
        )
    )

    player = RouteReplayBinding(model, "replay", missing_route_policy="native")
    player.install(routes_BSLK, key="demo")
    chosen.clear()
    loss, _ = _loss(model, rows)
    loss.backward()
    player.remove()
    match = (
        torch.stack([(a == b).all(-1) for a, b in zip(chosen, recorded_maps, strict=True)])
        .float()
        .mean()
    )
    return {
        "replay_match_rate": float(match),
        "natural_routing_changed": natural_changed,
        "route_bytes": int(routes_BSLK.numel() * routes_BSLK.element_size()),
        "route_dtype": str(routes_BSLK.dtype),
    }


def alignment_check(batch: int, seq_len: int) -> dict[str, Any]:
    """fp8 alignment after dispatch on grouped-GEMM experts: group sizes reaching the GEMM."""
    model, _, config = _build(seed=3, grouped_mm=True, align=True)
    config.fp8, config.fp8_recipe = "e4m3", "tensorwise"  # fp8 configs cannot be built without TE
    groups: list[list[int]] = []
    for module in model.modules():
        if type(module).__name__ == "AlignedMoELayer":
            module.experts.register_forward_pre_hook(lambda m, a: groups.append(a[1].tolist()))
    loss, _ = _loss(model, _rows(0, torch.distributed.get_rank(), batch, seq_len, "self"))
    loss.backward()
    return {"groups": groups, "aligned": all(g % 16 == 0 for layer in groups for g in layer)}


def _progress(message: str, start: float) -> None:
    if torch.distributed.get_rank() == 0:
        print(f"  [{time.perf_counter() - start:5.1f} s] {message}", flush=True)


def demo_worker(steps: int, batch: int, seq_len: int) -> dict[str, Any]:
    """Everything the demo reports, from this rank (rank 0's copy is printed)."""
    start = time.perf_counter()
    out: dict[str, Any] = {}
    for policy in ("constant", "self"):
        _progress(f"training {steps} steps with {policy} pads", start)
        out[policy] = train_policy(policy, steps, batch, seq_len)
    _progress("recording routes, perturbing the routers, replaying", start)
    out["replay"] = record_and_replay(batch, seq_len)
    _progress("fp8 alignment on grouped-GEMM experts", start)
    out["alignment"] = alignment_check(batch, seq_len)
    out["worker_seconds"] = time.perf_counter() - start
    return out
