"""What: route replay in YOUR training loop (an RL framework's own, no Megatron ``pretrain``): a tiny
MoE GPTModel built here with Megatron-Core's classes, rollouts from an "engine" (the same model
with its router weights perturbed by 5 % noise, standing in for an inference engine's other
numerics), written as a vLLM 0.34 dump (routes, log-probs, a per-sequence advantage), ingested by
``megatron-ext ingest-rollouts``, then a few PPO-clip steps of this script's loop with the dump's
routes replayed through ``megatron_ext.replay.RouteReplay`` (full activation recompute on, so the
backward's recomputed routers replay too). Prints one JSON line: the (token, layer) rows replayed
and how many routed exactly as the engine did, the loss per step, and the trainer/engine log-prob
mismatch of the first weights with and without replay (what replay removes).
Hardware: CPU, 2 gloo ranks (expert-parallel 2); drop --cpu on 2 GPUs.
Command: torchrun --nproc-per-node 2 examples/replay_in_your_loop.py --cpu
"""

import argparse
import base64
import io
import json
import os
import tempfile

import numpy as np
import torch

VOCAB, EXPERTS, TOPK, LAYERS = 128, 8, 2, 2
PROMPT, COMPLETION, PROMPTS, CHOICES = 8, 24, 8, 2
SEQ = PROMPT + COMPLETION
MICRO_BATCH = 4


def setup(cpu: bool) -> None:
    """torch.distributed from torchrun's environment, Megatron's groups (EP over every rank)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.distributed.init_process_group("gloo" if cpu else "nccl")
    if cpu:
        from megatron_ext.cpu.model_stack import enable_cpu_mode

        enable_cpu_mode()  # Megatron's MoE stack on CPU (a no-op with CUDA)
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=torch.distributed.get_world_size()
    )
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def build_model(cpu: bool) -> torch.nn.Module:
    """A 2-layer MoE GPTModel (8 experts, top-2, Megatron's local spec) with routing replay on."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", moe_enable_routing_replay=True,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        use_cpu_initialization=cpu, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return model if cpu else model.cuda()


def routers(model: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def per_token_logp(model: torch.nn.Module, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The model's log-prob of each next token: minus Megatron's per-token cross-entropy."""
    positions = torch.arange(SEQ, device=tokens_BS.device).expand_as(tokens_BS)
    labels = torch.roll(tokens_BS, -1, dims=1)  # the last position's label is never trained
    return -model(tokens_BS, positions, None, labels=labels)


def engine_rollouts(model: torch.nn.Module) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's sequences, routes ``[D, T, L, K]`` and log-probs of each token ``[D, T]``:
    the model with 5 % noise on its router weights (every rank the same: same seed)."""
    from megatron_ext.replay.binding import RouteReplayBinding

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT), generator=gen)
    completions = torch.randint(0, VOCAB, (PROMPTS * CHOICES, COMPLETION), generator=gen)
    tokens = torch.cat([prompts.repeat_interleave(CHOICES, 0), completions], dim=1)
    saved = [r.weight.detach().clone() for r in routers(model)]
    for router in routers(model):
        noise = torch.randn(router.weight.shape, generator=gen) * router.weight.std()
        router.weight.data.add_(0.05 * noise.to(router.weight.device))
    recorder = RouteReplayBinding(model, "record")  # records what the routers choose
    recorder.begin_record("engine", *tokens.shape)
    device = next(model.parameters()).device
    with torch.no_grad():
        logp_DT = per_token_logp(model, tokens.to(device))
    routes_DTLK = recorder.recorded_routes("engine").cpu().numpy()
    recorder.remove()
    for router, weight in zip(routers(model), saved, strict=True):
        router.weight.data.copy_(weight)
    # The log-prob of token t is computed at position t - 1.
    token_logp = np.zeros(tokens.shape, np.float32)
    token_logp[:, 1:] = logp_DT[:, :-1].cpu().numpy()
    return tokens.numpy(), routes_DTLK, token_logp


def npy_base64(array: np.ndarray) -> str:
    """vLLM 0.34's ``numpy2base64`` (utils/serial_utils.py): a whole ``.npy`` file, base64."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def write_vllm_dump(path: str, tokens, routes, logp) -> None:
    """One vLLM 0.34 CompletionResponse per prompt (``n`` choices, ``return_token_ids``): each
    choice's routes are rows ``[0, T - 1)`` (the engine never routes the last token), its
    ``logprobs`` the completion's; the RL framework adds each sequence's ``advantage``."""
    with open(path, "w") as f:
        for p in range(PROMPTS):
            choices = []
            for c in range(CHOICES):
                d = p * CHOICES + c
                choices.append({
                    "index": c, "text": "...", "finish_reason": "length",
                    "prompt_token_ids": tokens[d, :PROMPT].tolist(),
                    "token_ids": tokens[d, PROMPT:].tolist(),
                    "routed_experts": npy_base64(routes[d, :-1].astype(np.uint8)),
                    "logprobs": {"token_logprobs": logp[d, PROMPT:].tolist()},
                    "advantage": 1.0 if c == 0 else -1.0,  # e.g. a group-normalized reward
                })  # fmt: skip
            f.write(json.dumps({"object": "text_completion", "model": "m", "choices": choices}))
            f.write("\n")


def ingest(dump: str, prefix: str) -> None:
    """``megatron-ext ingest-rollouts``: tokens, loss mask, routes, log-probs, advantages."""
    from megatron_ext.cli.tool_commands import tool_command

    status = tool_command([
        "ingest-rollouts", "--format", "vllm", "--input", dump, "--output-prefix", prefix,
        "--num-layers", str(LAYERS), "--topk", str(TOPK), "--num-experts", str(EXPERTS),
        "--token-keys", "logprobs", "--sequence-keys", "advantages=advantage", "--no-progress",
    ])  # fmt: skip
    assert status in (0, None), status


def read_ingested(prefix: str) -> dict[str, np.ndarray]:
    """Every document (all of length SEQ here) of each file, stacked: what your loader reads."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = {}
    for name, suffix in (("tokens", ""), ("loss_mask", "_loss_mask"), ("routes", "_routes"),
                         ("logprobs", "_logprobs"), ("advantages", "_advantages")):  # fmt: skip
        data = IndexedDataset(prefix + suffix)
        out[name] = np.stack([np.asarray(data[i]) for i in range(len(data))])
    out["routes"] = out["routes"].reshape(-1, SEQ, LAYERS, TOPK)  # the sidecar's uint8 rows
    return out


class ReplayCounter:
    """Counts, in every router call (forward and recompute), the rows with a route and those
    the router used exactly (its routing map against the installed routes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.expected: np.ndarray | None = None  # [B, S, L, K] of the micro-batch running
        self.rows = self.exact = 0
        for ordinal, router in enumerate(routers(model)):
            router.register_forward_hook(lambda m, a, out, layer=ordinal: self._count(layer, out))

    def _count(self, layer: int, output) -> None:
        if self.expected is None:
            return
        routes_NK = self.expected[:, :, layer].transpose(1, 0, 2).reshape(-1, TOPK)  # s-major
        recorded = ~(routes_NK == 255).all(-1)
        want = np.zeros((routes_NK.shape[0], EXPERTS), bool)
        np.put_along_axis(want, routes_NK.clip(0, EXPERTS - 1).astype(np.int64), True, axis=1)
        got = output[1].detach().cpu().numpy()
        self.rows += int(recorded.sum())
        self.exact += int(((got == want).all(-1) & recorded).sum())


def mismatch(model, data, docs, replay=None) -> float:
    """Mean |trainer - engine| log-prob over the trained tokens of ``docs``, one forward."""
    from megatron_ext.training.policy_loss import MISMATCH, label_aligned, ppo_clip_loss

    device = next(model.parameters()).device
    tokens = torch.from_numpy(data["tokens"][docs]).to(device)
    if replay is not None:
        replay.set_routes(data["routes"][docs], key=("eval", len(docs)))
    with torch.no_grad():
        logp = per_token_logp(model, tokens)
    old = label_aligned(torch.from_numpy(data["logprobs"][docs]).to(device))
    mask = label_aligned(torch.from_numpy(data["loss_mask"][docs]).float().to(device))
    out = ppo_clip_loss(logp.flatten(), old.flatten(), old.flatten(), mask.flatten(),
                        clip_low=0.2, clip_high=0.28)  # fmt: skip
    return out.metrics[MISMATCH].item() / out.num_tokens.item()


def train(model, data, steps: int, counter: ReplayCounter) -> list[float]:
    """Your loop: each rank its half of the sequences in micro-batches, PPO-clip token mean over
    the global batch, gradients averaged over the data-parallel ranks, one Adam step a step."""
    from megatron.core import parallel_state

    from megatron_ext.replay import RouteReplay
    from megatron_ext.training.policy_loss import label_aligned, ppo_clip_loss

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = np.arange(len(data["tokens"])).reshape(world, -1)[rank].reshape(-1, MICRO_BATCH)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    device = next(model.parameters()).device
    tokens_global = torch.tensor(float(label_aligned(torch.from_numpy(
        data["loss_mask"]).float()).sum()))  # fmt: skip
    losses = []
    with RouteReplay(model) as replay:
        for _step in range(steps):
            total = torch.zeros(())
            for docs in mine:
                replay.set_routes(data["routes"][docs])  # before the forward, every micro-batch
                counter.expected = data["routes"][docs]
                column = {k: torch.from_numpy(data[k][docs]).to(device) for k in data}
                logp = per_token_logp(model, column["tokens"])
                out = ppo_clip_loss(
                    logp.flatten(),
                    label_aligned(column["logprobs"]).flatten(),
                    label_aligned(column["advantages"]).flatten(),
                    label_aligned(column["loss_mask"].float()).flatten(),
                    clip_low=0.2, clip_high=0.28,
                )  # fmt: skip
                (out.loss / tokens_global).backward()  # recompute replays the same routes
                total += out.loss.detach().cpu()
            counter.expected = None
            for p in model.parameters():  # data-parallel gradient average (experts: EP-sharded)
                if p.grad is not None and getattr(p, "allreduce", True):
                    group = parallel_state.get_data_parallel_group()
                    torch.distributed.all_reduce(p.grad, group=group)
            optimizer.step()
            optimizer.zero_grad()
            replay.clear()  # after the step's last backward
            torch.distributed.all_reduce(total)
            losses.append(round(float(total / tokens_global), 6))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (Megatron's MoE stack)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", help="where the dump and the ingested data go (a temp dir)")
    args = parser.parse_args()
    setup(args.cpu)
    model = build_model(args.cpu)
    tokens, routes, logp = engine_rollouts(model)
    first = torch.distributed.get_rank() == 0
    workdir = [args.workdir or (tempfile.mkdtemp(prefix="replay_in_your_loop_") if first else "")]
    torch.distributed.broadcast_object_list(workdir, src=0)  # rank 0's: one directory
    workdir = workdir[0]
    prefix = os.path.join(workdir, "rollouts")
    if first:
        write_vllm_dump(os.path.join(workdir, "rollouts.jsonl"), tokens, routes, logp)
        ingest(os.path.join(workdir, "rollouts.jsonl"), prefix)
    torch.distributed.barrier()
    data = read_ingested(prefix)
    assert (data["tokens"] == tokens).all()  # the records' order
    from megatron_ext.replay import RouteReplay

    docs = np.arange(len(tokens))
    native = mismatch(model, data, docs)
    with RouteReplay(model) as replay:
        replayed = mismatch(model, data, docs, replay)
    counter = ReplayCounter(model)
    losses = train(model, data, args.steps, counter)
    counts = torch.tensor([counter.rows, counter.exact])
    torch.distributed.all_reduce(counts)
    if first:
        print(json.dumps({
            "replay_rows": int(counts[0]), "replay_exact": int(counts[1]), "loss": losses,
            "logprob_mismatch": {"native": native, "replay": replayed},
            "documents": len(tokens), "workdir": workdir,
        }), flush=True)  # fmt: skip
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
