"""Model and capture helpers shared by the replay binding tests (imported by gloo workers).

Not a test module: tiny MoE GPT builders (with an SP-capable norm), batches, routing-map capture,
recording through a RouteReplayBinding and the routing maps installed routes should produce.
"""

import torch

BATCH, SEQ, VOCAB = 2, 16, 128


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm with Megatron's norm signature; Megatron's torch-norm wrapper refuses SP
    (it asserts) although a LayerNorm is per token and so exact on a sequence shard."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs) -> None:
        del kwargs
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def layer_spec(config):
    """The local GPT layer spec, with an SP-capable norm when sequence parallelism is on."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if not config.sequence_parallel:
        return None
    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * config.num_layers, layer_norm=SequenceParallelLayerNorm
    )


def tiny_replay_model(recompute: bool):
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    extra = {}
    if recompute:
        extra = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    config = tiny_moe_config(moe_enable_routing_replay=True, **extra)
    return build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=SEQ, layer_spec=layer_spec(config))


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).expand(BATCH, SEQ)


def routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def capture_maps(model):
    """Forward hooks that log each router's routing map (forward and recompute calls)."""
    log: dict[int, list[torch.Tensor]] = {}
    handles = []
    for router in routers(model):

        def hook(module, args, output, number=router.layer_number):
            log.setdefault(number, []).append(output[1].detach().clone())

        handles.append(router.register_forward_hook(hook))
    return log, handles


def loss(model, tokens, positions):
    return model(tokens, positions, attention_mask=None, labels=tokens).sum()


def record(model, tokens, positions, key=0):
    from megatron_ext.replay.binding import RouteReplayBinding

    binding = RouteReplayBinding(model, "record")
    binding.begin_record(key, BATCH, SEQ)
    loss(model, tokens, positions).backward()
    routes = binding.recorded_routes(key)
    binding.remove()
    return routes


def expected_maps(binding, routes_BSLK):
    """Routing maps [N, E] the installed routes should give on this rank, per layer number."""
    from megatron_ext.replay.layout import rows_for_router

    rows = rows_for_router(routes_BSLK, binding._my_positions(BATCH, SEQ)).long()
    num_experts = binding.config.num_moe_experts
    return {
        r.layer_number: torch.zeros(rows.shape[0], num_experts, dtype=torch.bool).scatter(
            1, rows[:, r.moe_ordinal], True
        )
        for r in binding.replays
    }


def cpu_sequence_parallel_backward() -> None:
    """Workaround until megatron_ext.cpu covers it (requested in /tmp/team/requests.md): the SP
    backward of tensor_parallel.layers allocates on torch.cuda.current_device()."""
    from megatron.core.tensor_parallel import layers

    from megatron_ext import cpu

    if cpu.cpu_mode_enabled() and not isinstance(layers.torch, cpu._TorchProxy):
        layers.torch = cpu._TorchProxy({"current_device": lambda: "cpu"})


def build_model_for_seq(seq: int):
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    config = tiny_moe_config(moe_enable_routing_replay=True)
    return build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=seq)
