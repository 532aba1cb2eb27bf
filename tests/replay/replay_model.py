"""Model and capture helpers shared by the replay binding tests (imported by gloo workers).

Not a test module: tiny MoE GPT and HybridModel builders (SP-capable via megatron_ext.testing), batches, routing-map capture,
recording through a RouteReplayBinding and the routing maps installed routes should produce.
"""

import torch

BATCH, SEQ, VOCAB = 2, 16, 128


def tiny_replay_model(recompute: bool):
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    config = tiny_moe_config(moe_enable_routing_replay=True, **_recompute_fields(recompute))
    return build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=SEQ)


def _recompute_fields(recompute: bool) -> dict:
    if not recompute:
        return {}
    return {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }


def tiny_hybrid_model(recompute: bool, pattern: str = "*E*E"):
    """A ``HybridModel`` (local-module stack spec): routers on the pattern's ``E`` layers only."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_ext.moe.layer_specs import get_local_hybrid_stack_spec
    from megatron_ext.testing import tiny_moe_config

    # Megatron's MoE metrics tracker is process-global and sized by the first num_layers it sees
    # (2, from earlier models in this worker); this model has more layers.
    destroy_moe_metrics_tracker()
    config = tiny_moe_config(
        num_layers=len(pattern), moe_enable_routing_replay=True, **_recompute_fields(recompute)
    )
    return HybridModel(
        config=config,
        hybrid_stack_spec=get_local_hybrid_stack_spec(config.num_moe_experts),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
    )


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


def build_model_for_seq(seq: int):
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    config = tiny_moe_config(moe_enable_routing_replay=True)
    return build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=seq)
