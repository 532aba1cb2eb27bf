"""The ``replay`` benchmark's model and its recorded routes, also used by tools/gpu/gpu_check.py.

Routes are recorded with Megatron's own ``RouterReplay`` in both layouts. Router rows are
``s * B + b`` (the router's ``[S, B, H]`` input), so for B=2, S=2::

    Megatron, per layer [S*B, K]    rows (s0 b0) (s0 b1) (s1 b0) (s1 b1)
    megatron_ext [B, S, L, K]       [b0: s0 s1] [b1: s0 s1], every layer's K experts per token
"""

from collections.abc import Callable

import torch


def replay_model(
    batch: int, seq: int, layers: int, device="cpu"
) -> tuple[torch.nn.Module, Callable[[], None], list]:
    """The benchmark's model: a tiny MoE ``GPTModel`` (local spec, 8 experts, top-2, hidden 128,
    routing replay enabled) in eval mode on ``device``, seeded; returns it, its no-grad forward on
    one fixed random ``[batch, seq]`` batch, and its routers."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    torch.manual_seed(0)
    config = tiny_moe_config(
        num_layers=layers, hidden_size=128, moe_ffn_hidden_size=128, moe_enable_routing_replay=True
    )
    # Eval mode: no dropout, so every timed forward computes the same routing.
    model = build_tiny_gpt(config, vocab_size=256, max_seq_len=seq).eval().to(device)
    tokens = torch.randint(0, 256, (batch, seq)).to(device)
    positions = torch.arange(seq, device=device).expand(batch, seq)

    def forward() -> None:
        with torch.no_grad():
            model(tokens, positions, attention_mask=None)

    return model, forward, [m for m in model.modules() if isinstance(m, TopKRouter)]


def routes_match(maps_NE: list[torch.Tensor], recorded_NK: list[torch.Tensor]) -> bool:
    """Every router's routing map (one per layer, in forward order) chose exactly its recorded
    top-k experts."""
    # A routing map's nonzero columns come out ascending per row: compare with sorted top-k.
    return len(maps_NE) == len(recorded_NK) and all(
        torch.equal(m.nonzero()[:, 1].view(-1, t.shape[1]), t.sort(-1).values)
        for m, t in zip(maps_NE, recorded_NK, strict=True)
    )


def record_routes(
    routers: list, forward: Callable[[], None], batch: int, seq: int
) -> tuple[list, torch.Tensor]:
    """Megatron's RECORD of one ``forward`` by ``routers``: per layer ``[S*B, K]`` int64 in router
    row order, and the same routes as megatron_ext's uint8 ``[B, S, L, K]`` on the model's device."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_ext.common.token_positions import router_row_positions
    from megatron_ext.replay.layout import rows_for_router

    # These routers' own instances: Megatron's process-wide list also holds any other model's.
    instances = [r.router_replay for r in routers]
    for instance in instances:
        instance.set_router_replay_action(RouterReplayAction.RECORD)
    forward()
    recorded = [instance.get_recorded_indices() for instance in instances]
    for instance in instances:
        instance.clear_router_replay_action()
    rows_NLK = torch.stack(recorded, dim=1).to(torch.uint8)  # router rows are s-major
    order = router_row_positions(batch, seq).to(rows_NLK.device)
    routes_BSLK = torch.empty_like(rows_NLK)
    routes_BSLK[order] = rows_NLK
    routes_BSLK = routes_BSLK.reshape(batch, seq, len(recorded), -1)
    # The binding's own slicing gives the router rows back: the two layouts hold the same routes.
    assert torch.equal(rows_for_router(routes_BSLK, order), rows_NLK)
    return recorded, routes_BSLK
