"""Tier: Megatron on one rank (gloo world of 1; EP=2 covered in test_token_dispatcher).

GPTModel and HybridModel switched onto AlignedMoELayer by the spec functions: every MoE layer is
swapped, nvfp4-aligned groups reach the grouped GEMM, logits/loss/grads equal the stock model.
"""

import pytest
import torch

from megatron_ext.testing import run_distributed

from .test_token_dispatcher import set_precision


def _model_checks() -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_ext.moe.layer_specs import (
        _use_grouped_mm_experts,
        get_aligned_gpt_layer_local_spec,
        get_local_hybrid_stack_spec,
    )
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.moe.moe_layer import AlignedMoELayer
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    alignment = MoEAlignmentConfig(moe_dispatch_align=True)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, 24)
    res: dict = {}

    def run(model):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    def compare(stock, ours, cfg_ours, name):
        ours.load_state_dict(stock.state_dict())
        ref = run(stock)
        set_precision(cfg_ours, "nvfp4")
        groups: list = []
        moe_layers = [m for m in ours.modules() if isinstance(m, AlignedMoELayer)]
        for m in moe_layers:
            m.realign()  # the precision set after build, passed down
            m.experts.register_forward_pre_hook(lambda mod, a: groups.append(a[1].tolist()))
        got = run(ours)
        diff = max(float((ref[1][k] - got[1][k]).abs().max()) for k in ref[1])
        res[name] = {
            "moe_layers": len(moe_layers),
            "loss": (float(ref[0]), float(got[0])),
            "grad_diff": diff,
            "groups": groups,
            "n_grads": (len(ref[1]), len(got[1])),
        }

    # GPTModel (4 MoE layers), grouped_mm experts. Megatron's MoE metrics tracker is
    # process-global and sized by the first num_layers it sees: keep 4 layers in both models.
    cfg = tiny_moe_config(num_layers=4)
    torch.manual_seed(0)
    stock = build_tiny_gpt(
        cfg, layer_spec=_use_grouped_mm_experts(get_gpt_layer_local_spec(num_experts=8))
    )
    cfg_ours = tiny_moe_config(num_layers=4)
    metrics = ExpertLoadMetrics(num_experts=8)
    ours = build_tiny_gpt(
        cfg_ours,
        layer_spec=get_aligned_gpt_layer_local_spec(
            alignment, 8, grouped_mm=True, load_metrics=metrics
        ),
    )
    compare(stock, ours, cfg_ours, "gpt")
    res["gpt_load"] = metrics.summary()

    # HybridModel "*E*E": local-module stack spec, stock vs aligned.
    def hybrid(cfg, spec):
        return HybridModel(
            config=cfg,
            hybrid_stack_spec=spec,
            vocab_size=128,
            max_sequence_length=64,
            hybrid_layer_pattern="*E*E",
            position_embedding_type="rope",
        )

    cfg = tiny_moe_config(num_layers=4)
    stock = hybrid(cfg, get_local_hybrid_stack_spec(8, grouped_mm=True))
    cfg_ours = tiny_moe_config(num_layers=4)
    ours = hybrid(cfg_ours, get_local_hybrid_stack_spec(8, alignment=alignment, grouped_mm=True))
    compare(stock, ours, cfg_ours, "hybrid")
    return res


def test_gpt_and_hybrid_models_align_and_match_stock():
    (res,) = run_distributed(_model_checks, 1)
    for name, moe_layers in (("gpt", 4), ("hybrid", 2)):
        r = res[name]
        assert r["moe_layers"] == moe_layers, r
        assert r["n_grads"][0] == r["n_grads"][1] > 0
        ref_loss, got_loss = r["loss"]
        assert ref_loss > 1.0  # cross entropy over 128 tokens: a real, non-vacuous loss
        # fp32; zero pad rows add exact zeros inside the grouped GEMM sums.
        assert abs(ref_loss - got_loss) <= 1e-6 and r["grad_diff"] <= 1e-6, r
        assert len(r["groups"]) == moe_layers and all(n % 128 == 0 for g in r["groups"] for n in g)
    load = res["gpt_load"]
    tokens = load["layer1/tokens"]
    assert sum(tokens) == 2 * 24 * 2
    # max_vio from the recorded counts, by its definition (max - mean) / mean:
    mean = sum(tokens) / len(tokens)
    assert load["layer1/expert_max_vio"] == pytest.approx((max(tokens) - mean) / mean)
    assert load["layer1/expert_max_vio"] > 0  # 96 routes over 8 experts: never exactly even here
    assert "layer4/tokens" in load


def test_block_specs_with_tuples_are_aligned_and_a_second_application_is_named():
    """A block spec whose layer_specs is a tuple (not a list) is walked too; aligning an aligned
    spec says so instead of 'no MoELayer'."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_ext.moe.layer_specs import _contains, with_aligned_moe
    from megatron_ext.moe.moe_layer import AlignedMoELayer
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    layer = get_gpt_layer_local_spec(num_experts=8)
    block = TransformerBlockSubmodules(layer_specs=(layer, layer))
    aligned = with_aligned_moe(block, MoEAlignmentConfig(moe_dispatch_align=True))
    assert isinstance(aligned.layer_specs, tuple) and len(aligned.layer_specs) == 2
    assert all(
        _contains(s, AlignedMoELayer) and not _contains(s, MoELayer) for s in aligned.layer_specs
    )
    with pytest.raises(ValueError, match="already AlignedMoELayer"):
        with_aligned_moe(aligned, MoEAlignmentConfig(moe_dispatch_align=True))
    with pytest.raises(ValueError, match="contains no MoELayer"):
        with_aligned_moe(get_gpt_layer_local_spec(), MoEAlignmentConfig(moe_dispatch_align=True))
