"""The CPU main job: Megatron's tiny MoE GPTModel trained for a few steps at EP=2 on 2 gloo processes.

Each rank reads its own packs from the embedded corpus, runs forward and backward through Megatron's real
MoELayer (alltoall dispatcher), averages gradients the way Megatron's DDP would (dense parameters over the
data-parallel group, expert parameters over the expert-data-parallel group) and steps ``torch.optim.AdamW``.
Per step it prints the loss and the tokens each EP rank received.

    megatron-ext demo --steps 4
"""

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.testing import run_distributed

EP = 2


def reduce_gradients(model: torch.nn.Module) -> None:
    """Averages gradients like Megatron's DDP: dense params over DP, expert params over expert-DP."""
    from megatron.core import parallel_state

    dense_group = parallel_state.get_data_parallel_group()
    expert_group = parallel_state.get_expert_data_parallel_group()
    for param in model.parameters():
        if param.grad is None:
            continue
        group = dense_group if getattr(param, "allreduce", True) else expert_group
        size = torch.distributed.get_world_size(group)
        if size > 1:
            torch.distributed.all_reduce(param.grad, group=group)
            param.grad /= size


def _train_worker(steps: int, seq_len: int, batch: int) -> dict[str, Any]:
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.corpus import VOCAB_SIZE, corpus_stream
    from megatron_ext.training.router_probe import RouterProbe

    rank = torch.distributed.get_rank()
    model = build_tiny_gpt(tiny_moe_config(), vocab_size=VOCAB_SIZE, max_seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    for step in range(steps):
        offset = ((step * torch.distributed.get_world_size() + rank) * batch) * (seq_len + 1)
        stream = corpus_stream(offset, batch * (seq_len + 1)).reshape(batch, seq_len + 1)
        tokens = torch.as_tensor(stream[:, :-1])
        labels = torch.as_tensor(stream[:, 1:])
        positions = torch.arange(seq_len).expand(batch, seq_len)
        start = time.perf_counter()
        with RouterProbe(model) as probe:
            loss_BS = model(tokens, positions, attention_mask=None, labels=labels)
            loss = loss_BS.float().mean()
            loss.backward()
        reduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        history.append(
            {
                "step": step,
                "loss": float(global_loss) / torch.distributed.get_world_size(),
                "tokens_per_ep_rank": probe.tokens_per_ep_rank(EP).tolist(),
                "seconds": time.perf_counter() - start,
            }
        )
    return {"history": history}


def main(args: argparse.Namespace) -> int:
    """Runs the demo and prints a per-step report."""
    start = time.perf_counter()
    print(f"megatron_ext demo: tiny MoE GPTModel, EP={EP}, 2 gloo ranks on CPU, {args.steps} steps")
    result = run_distributed(_train_worker, 2, args.steps, 128, 4, ep=EP, timeout=600)[0]
    for entry in result["history"]:
        per_rank = np.asarray(entry["tokens_per_ep_rank"])
        layers = ", ".join(
            f"L{layer}: " + "/".join(str(int(c)) for c in row) for layer, row in enumerate(per_rank)
        )
        print(
            f"step {entry['step']}: loss {entry['loss']:.4f}  "
            f"tokens per EP rank [{layers}]  {entry['seconds'] * 1000:.0f} ms"
        )
    losses = [entry["loss"] for entry in result["history"]]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; wall time {time.perf_counter() - start:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
