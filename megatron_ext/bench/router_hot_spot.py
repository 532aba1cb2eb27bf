"""Benchmark: pad hot spot at router level for EP = 8 and 64, with a trained-looking 64-expert router.

Hidden states come from Megatron's real tiny GPTModel (first transformer layer's output, rope, per-document
causal attention as the packed data pipeline feeds it) for packs of the embedded corpus, half of each pack
padding. They are routed by Megatron's real ``TopKRouter`` (64 experts, top-4) whose weights are k-means
centroids of real-text hidden states: like a trained router, experts specialise on regions of the data and
real text spreads across them. Reported: peak/mean tokens per EP rank, worst over batches.
"""

import numpy as np
import torch

from megatron_ext.bench.registry import BenchResult, register_benchmark
from megatron_ext.testing import run_distributed

NUM_EXPERTS, TOPK, EP_SIZES = 64, 4, (8, 64)
POLICIES = ("no padding", "constant id", "self tokens")


def _kmeans(x_ND: torch.Tensor, k: int, iters: int = 20) -> torch.Tensor:
    """``k`` centroids of the rows of ``x_ND`` (Lloyd's iterations from a seeded sample)."""
    # Legend: N rows, D hidden.
    gen = torch.Generator().manual_seed(0)
    centroids = x_ND[torch.randperm(x_ND.shape[0], generator=gen)[:k]].clone()
    for _ in range(iters):
        assign_N = torch.cdist(x_ND, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, assign_N, x_ND)
        counts = torch.bincount(assign_N, minlength=k).unsqueeze(1)
        # An empty cluster keeps its centroid (the clamp only avoids 0/0 in the unused branch).
        centroids = torch.where(counts > 0, sums / counts.clamp_min(1), centroids)
    return centroids


def _router_worker(seq_len: int, num_packs: int) -> dict:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.data.batch import document_attention_mask
    from megatron_ext.data.padding import pad_pack
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.corpus import CONSTANT_PAD_ID, VOCAB_SIZE, corpus_stream

    torch.manual_seed(0)
    dense = build_tiny_gpt(
        tiny_moe_config(num_moe_experts=None), vocab_size=VOCAB_SIZE, max_seq_len=seq_len
    )
    captured = {}
    dense.decoder.layers[0].register_forward_hook(
        lambda m, i, o: captured.update(h=o[0] if isinstance(o, tuple) else o)
    )

    def hidden(policy: str, start: int) -> torch.Tensor:
        packs = []
        for b in range(num_packs):
            text = corpus_stream(start + b * seq_len, seq_len)
            n = seq_len if policy == "no padding" else seq_len // 2
            mode = "constant" if policy == "constant id" else "self"
            packs.append(
                pad_pack(text[:n], np.array([n]), seq_len, policy=mode, pad_id=CONSTANT_PAD_ID)
            )
        tokens = torch.as_tensor(np.stack([p.tokens_S for p in packs]))
        positions = torch.as_tensor(np.stack([p.position_ids_S for p in packs]))
        cu = torch.as_tensor(np.stack([p.cu_seqlens for p in packs]))
        with torch.no_grad():
            dense(tokens, positions, attention_mask=document_attention_mask(cu, seq_len))
        return captured["h"]  # [s, b, h]

    # A trained-looking router: centroids of real-text hidden states from a separate part of the corpus.
    config = tiny_moe_config(
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=0.0
    )
    router = TopKRouter(config=config, pg_collection=get_default_pg_collection())
    fit = hidden("no padding", 10**6)
    router.weight.data.copy_(_kmeans(fit.reshape(-1, fit.shape[-1]), NUM_EXPERTS))
    router.eval()
    out = {}
    for policy in POLICIES:
        with torch.no_grad():
            _, routing_map_TE = router(hidden(policy, 0))
        # Experts are laid out contiguously over EP ranks, as Megatron places them.
        counts_E = routing_map_TE.sum(0).double()
        out[policy] = {
            ep: float(counts_E.view(ep, -1).sum(1).max() / counts_E.view(ep, -1).sum(1).mean())
            for ep in EP_SIZES
        }
    return out


@register_benchmark("router_hot_spot")
def router_hot_spot(quick: bool) -> BenchResult:
    """Peak/mean tokens per EP rank at EP=8 and EP=64 for a 64-expert top-4 router, 50 % padding."""
    seq_len, num_packs = (128, 8) if quick else (256, 32)
    result = run_distributed(_router_worker, 1, seq_len, num_packs)[0]
    base = result["no padding"]
    rows = [
        [policy]
        + [v for ep in EP_SIZES for v in (result[policy][ep], result[policy][ep] / base[ep])]
        for policy in POLICIES
    ]
    columns = ["pads filled with"]
    for ep in EP_SIZES:
        columns += [f"EP={ep} peak/mean", "vs no padding"]
    return BenchResult(
        title="Pad hot spot at router level: 64 experts, top-4, EP=8 and EP=64 (50 % padding)",
        columns=columns,
        rows=rows,
        notes=(
            f"{num_packs} packs x {seq_len} tokens of the embedded corpus; hidden states from Megatron's "
            "tiny GPTModel (layer 1 output, rope, per-document causal mask; pads are their own segment); "
            "Megatron TopKRouter with k-means-centroid weights fitted on other real text."
        ),
        extra={"peak_over_mean": {p: {str(k): v for k, v in r.items()} for p, r in result.items()}},
    )
