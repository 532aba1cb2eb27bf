"""Tier: Megatron on one gloo rank (real GPTModel, AlignedMoELayer, torch._grouped_mm experts).

``--cpu`` with fp8/fp4 rehearses the quantized run's expert-group alignment: after
:func:`rehearse_quantized_moe`, every group reaching the grouped GEMM is a multiple of the recipe's
size (fp8 16, mxfp8 32, nvfp4 128), and with the dispatcher's alignment switched off the same forward
is refused before a group reaches the GEMM, so the check is live. Attention and the router stay unquantized.
"""

import pytest
import torch

from megatron_ext.testing import run_distributed

FP8 = {"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp4": None, "fp4_recipe": None}
MXFP8 = {**FP8, "fp8_recipe": "mxfp8"}
NVFP4 = {"fp8": None, "fp8_recipe": None, "fp4": "e2m1", "fp4_recipe": "nvfp4"}


def _rehearse(precision: dict, break_aligner: bool) -> dict:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.moe.grouped_mm_linear import UnalignedGroupError
    from megatron_ext.moe.layer_specs import get_aligned_gpt_layer_local_spec
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.cpu_rehearsal import GroupLog, rehearse_quantized_moe
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, force_reset_rng=True)
    config = tiny_moe_config()
    alignment = MoEAlignmentConfig(moe_dispatch_align=True, moe_expert_load_metrics=True)
    spec = get_aligned_gpt_layer_local_spec(alignment, config.num_moe_experts, grouped_mm=True)
    model = build_tiny_gpt(config, vocab_size=256, max_seq_len=64, layer_spec=spec)
    log = GroupLog()
    aligns = rehearse_quantized_moe(model, precision, log)
    if break_aligner:  # the dispatcher forgets the precision: groups go out unaligned
        for layer in model.modules():
            if hasattr(layer, "token_dispatcher"):
                layer.token_dispatcher.config = config
                layer.realign(config)
    tokens = torch.randint(0, 256, (2, 37))
    position_ids = torch.arange(37).expand(2, 37)
    try:
        model(tokens, position_ids, attention_mask=None).sum().backward()
    except (UnalignedGroupError, ValueError) as err:  # the GEMM backend or the padding stand-in
        return {"aligns": aligns, "error": str(err), "groups": log.groups}
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    layers = [m for m in model.modules() if hasattr(m, "token_dispatcher")]
    return {
        "layer_fp8": [layer.config.fp8 for layer in layers],
        "experts_fp8": [layer.experts.config.fp8 for layer in layers],
        "dispatcher_fp8": [layer.token_dispatcher.config.fp8 for layer in layers],
        "aligns": aligns,
        "error": None,
        "groups": log.groups,
        "unaligned": log.unaligned,
        "last": log.last,
        "model_fp8": config.fp8,
        "router_fp8": [r.config.fp8 for r in routers],
    }


@pytest.mark.parametrize(("precision", "multiple"), [(FP8, 16), (MXFP8, 32), (NVFP4, 128)])
def test_groups_reach_the_gemm_aligned(precision, multiple):
    (out,) = run_distributed(_rehearse, 1, precision, False)
    assert out["error"] is None
    assert out["aligns"] == [multiple, multiple]
    assert out["groups"] > 0 and out["unaligned"] == 0
    assert all(n % multiple == 0 for n in out["last"])
    assert sum(out["last"]) > 0
    # Only the MoE layers' dispatchers and experts rehearse: the model's config, the routers and
    # the layers themselves (whose fp8 picks TE's te_checkpoint for MoE recompute) stay unquantized.
    assert out["model_fp8"] is None and out["router_fp8"] == [None, None]
    assert out["layer_fp8"] == [None, None]
    assert out["experts_fp8"] == out["dispatcher_fp8"] == [precision["fp8"]] * 2


def test_without_the_aligner_the_backend_refuses():
    # 2 x 37 tokens, top-2, 8 experts: groups of arbitrary size, as an unaligned dispatcher sends.
    (out,) = run_distributed(_rehearse, 1, FP8, True)
    # The experts' padding stand-in refuses before any unaligned group reaches the GEMM.
    assert out["error"] is not None and "--moe-dispatch-align is inactive" in out["error"]
    assert out["groups"] == 0
