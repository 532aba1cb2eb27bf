"""Tier: Megatron on one rank (a stand-in binding) and gloo ranks (real Megatron GPTModel and
HybridModel on CPU, one rank). What route replay binds, before any routes flow.

``KeyedRouterReplay`` joins Megatron's global instance list as any ``RouterReplay`` does and
hands each router call to its binding unchanged; ``replayed_routers`` lists the decoder's
routers (an MTP router excluded) whose layer numbers ``model_moe_layer_numbers`` gives for a
``GPTModel`` (``--moe-layer-freq``) and a ``HybridModel`` (its pattern's ``E`` positions);
``unwrap_model`` strips DDP-style wrappers; the micro-batch context's ``decoder_blocks`` finds each
model's decoder stack.
"""

import torch

from megatron_ext.testing import run_distributed
from tests.replay.replay_model import SEQ, VOCAB, tiny_hybrid_model


class _StandInBinding:
    """Records what ``route`` receives and answers with a fixed top-k."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def route(self, *args):
        self.calls.append(args)
        return self.answer


def test_keyed_router_replay_joins_megatron_list_and_asks_its_binding():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_ext.replay.keyed_router_replay import KeyedRouterReplay

    answer = (torch.tensor([[0.7, 0.3]]), torch.tensor([[4, 1]]))
    binding = _StandInBinding(answer)
    replay = KeyedRouterReplay(binding, moe_ordinal=1, layer_number=3)
    instances = RouterReplay.global_router_replay_instances
    try:
        assert instances[-1] is replay  # RouterReplay.__init__ appends: the binding swaps slots
        assert (replay.moe_ordinal, replay.layer_number) == (1, 3)
        scores = torch.randn(1, 8)

        def compute(*args):
            return torch.topk(scores, 2)

        got = replay.get_replay_topk(scores, 2, None, None, default_compute_topk=compute)
        assert got is answer
        ((who, *args),) = binding.calls
        assert who is replay and args[0] is scores and args[1:] == [2, None, None, compute]
    finally:
        instances.remove(replay)


def test_unwrap_strips_module_wrappers():
    from megatron_ext.replay.keyed_router_replay import unwrap_model

    model = torch.nn.Linear(2, 2)

    class Wrapper(torch.nn.Module):  # DDP / Float16Module keep the model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert unwrap_model(Wrapper(Wrapper(model))) is model
    assert unwrap_model(model) is model


def _what_gets_bound() -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_ext.common.micro_batch import decoder_blocks
    from megatron_ext.replay.keyed_router_replay import model_moe_layer_numbers, replayed_routers
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    config = tiny_moe_config(num_layers=3, moe_layer_freq=[0, 1, 1])
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)  # dense layer 1
    gpt = build_tiny_gpt(config, vocab_size=VOCAB, max_seq_len=SEQ, layer_spec=spec)
    hybrid = tiny_hybrid_model(recompute=False, pattern="*E*E")
    out = {}
    for name, model in (("gpt", gpt), ("hybrid", hybrid)):
        out[name] = {
            "numbers": model_moe_layer_numbers(model),
            "routers": [r.layer_number for r in replayed_routers(model)],
            # The decoder stack (a LocalHybridStack is a HybridStack), and no other module.
            "blocks": [m is model.decoder for m in decoder_blocks(model)],
        }
    # An MTP layer's router is not bound (flagged here rather than building an MTP block).
    first = replayed_routers(gpt)[0]
    first.is_mtp_layer = True
    out["gpt"]["routers_without_mtp"] = [r.layer_number for r in replayed_routers(gpt)]
    return out


def test_routers_and_layer_numbers_of_gpt_and_hybrid_models():
    (out,) = run_distributed(_what_gets_bound, 1)
    # GPTModel, --moe-layer-freq [0, 1, 1]: layer 1 dense, routers on layers 2 and 3.
    assert out["gpt"]["numbers"] == out["gpt"]["routers"] == [2, 3]
    assert out["gpt"]["routers_without_mtp"] == [3]
    assert out["gpt"]["blocks"] == [True]
    # HybridModel "*E*E": MoE at the E positions 2 and 4 (its moe_layer_freq does not say so).
    assert out["hybrid"]["numbers"] == out["hybrid"]["routers"] == [2, 4]
    assert out["hybrid"]["blocks"] == [True]
