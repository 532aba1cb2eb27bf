"""Tier: torch and a real Megatron TransformerBlock on CPU (one rank). The micro-batch context:
the forward step's key in the forward, the key of the micro-batch in backward in a recompute
after later forwards, the marker viewless and identity, no recompute after a block starts."""

import torch

from megatron_ext.common.micro_batch import MicroBatchContext, mark_backward
from megatron_ext.testing import run_distributed


def test_marker_is_identity_and_announces_its_key_when_backward_starts():
    seen = []
    x = torch.randn(3, 4, requires_grad=True)
    marked_a = mark_backward(x * 2, seen.append, "mb0")
    marked_b = mark_backward(x * 3, seen.append, "mb1")
    assert torch.equal(marked_a, x * 2) and marked_a._base is None  # Megatron frees it by _base
    assert seen == []  # nothing announced in the forward
    marked_b.sum().backward()  # backwards in reverse order of the forwards
    marked_a.sum().backward()
    assert seen == ["mb1", "mb0"]
    assert torch.equal(x.grad, torch.full_like(x, 5.0))  # gradients pass through unchanged


def _keys_seen_in_recompute() -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_ext.testing import tiny_moe_config

    config = tiny_moe_config(
        num_layers=1,
        num_moe_experts=None,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    block = TransformerBlock(config, get_gpt_layer_local_spec())
    context = MicroBatchContext()
    context.attach(block)
    context.attach(block)  # once per block
    seen = []  # (context key, recomputing, grad enabled) at each pass of the MLP
    block.layers[0].mlp.register_forward_pre_hook(
        lambda *_: seen.append((context.key, context.recomputing, torch.is_grad_enabled()))
    )
    outputs = {}
    for key in ("mb0", "mb1"):
        context.begin(key)
        hidden = torch.randn(4, 2, config.hidden_size, requires_grad=True)
        outputs[key] = block(hidden, attention_mask=None)
    forwards = list(seen)
    outputs["mb0"].sum().backward()  # mb0's backward after mb1's forward
    after_backward = context.recomputing
    context.begin("mb2", training=False)
    with torch.no_grad():
        block(torch.randn(4, 2, config.hidden_size), attention_mask=None)
    return {
        "forwards": forwards,
        "recompute": seen[2:3],
        "after_backward": after_backward,
        "eval": (seen[3], context.training),
        "hooks": len(context._attached),
        "viewless": outputs["mb1"]._base is None,
    }


def test_a_recompute_reads_the_key_of_the_micro_batch_in_backward():
    (out,) = run_distributed(_keys_seen_in_recompute, 1)
    # Full recompute: the forward runs without grad, the recompute with grad in backward.
    assert out["forwards"] == [("mb0", False, False), ("mb1", False, False)]
    assert out["recompute"] == [("mb0", True, True)]  # not mb1, the last forward
    assert out["after_backward"]  # until a block's next forward starts
    assert out["eval"] == (("mb2", False, False), False)
    assert out["hooks"] == 1 and out["viewless"]
