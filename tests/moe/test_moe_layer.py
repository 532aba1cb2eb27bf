"""Tier: Megatron on one rank (gloo world of 1, real MoELayer / GPTModel on CPU). AlignedMoELayer.

- The expert padding stand-in: installed only while our aligner is active (TE's padding stays
  otherwise and serves whenever the aligner is inactive), and it checks Megatron's own multiple.
- Load metrics count each training micro-batch exactly once: not again in the recompute of
  full or ``moe`` selective activation checkpointing, and not in evaluation / no_grad forwards.
"""

import pytest
import torch

from megatron_ext.testing import run_distributed

from .test_token_dispatcher import _bitwise, build_layer, fwd_bwd, set_precision

B, S, TOPK = 2, 24, 2


class ReferencePadding(torch.nn.Module):
    """What TE's ``Fp8Padding`` does (TE cannot run here): pad each group with zero rows."""

    def __init__(self, align: int) -> None:
        super().__init__()
        self.align, self.calls = align, 0

    def forward(self, x, m_splits):
        self.calls += 1
        padded = [-(-n // self.align) * self.align for n in m_splits]
        parts = [
            torch.cat([p, p.new_zeros(m - n, *p.shape[1:])])
            for p, n, m in zip(torch.split(x, m_splits), m_splits, padded, strict=True)
        ]
        return torch.cat(parts), padded


class ReferenceUnpadding(torch.nn.Module):
    """What TE's ``Fp8Unpadding`` does: drop the zero rows again."""

    def __init__(self, align: int) -> None:
        super().__init__()
        self.align = align

    def forward(self, x, m_splits):
        padded = [-(-n // self.align) * self.align for n in m_splits]
        return torch.cat([p[:n] for p, n in zip(torch.split(x, padded), m_splits, strict=True)])


def _padding_checks() -> dict:
    from megatron_ext.moe.moe_layer import AlreadyAlignedPadding, tell_experts_groups_are_aligned
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    res: dict = {}
    ref_layer, _, _ = build_layer("alltoall", aligned=False)
    ref = fwd_bwd(ref_layer)

    def aligned_layer(override, precision=None, **config_changes):
        # Build as an AlignedMoELayer with this override (no pretrain_gpt argument check: the
        # layer's own construction check is all there is). ``precision`` and ``config_changes``
        # are set before construction (an fp8 config cannot be built without TE).
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatron_ext.moe.layer_specs import _use_grouped_mm_experts, with_aligned_moe
        from megatron_ext.testing import tiny_moe_config

        cfg = tiny_moe_config(moe_token_dispatcher_type="alltoall")
        if precision is not None:
            set_precision(cfg, precision)
        for name, value in config_changes.items():
            setattr(cfg, name, value)
        spec = _use_grouped_mm_experts(get_gpt_layer_local_spec(num_experts=8))
        alignment = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=override)
        layer = with_aligned_moe(spec, alignment).submodules.mlp(
            config=cfg, pg_collection=None, is_mtp_layer=False
        )
        layer.set_layer_number(1)
        layer.load_state_dict(ref_layer.state_dict())
        groups = []  # the group sizes the grouped GEMM itself receives (host lists)
        layer.experts.linear_fc1.register_forward_pre_hook(lambda m, a: groups.append(list(a[1])))
        return layer, cfg, groups

    # An fp8 build keeps TE's padding when our aligner is inactive (override 1 under mxfp8):
    # the experts pad their own groups, and the outputs equal the unpadded reference.
    layer, cfg, groups = aligned_layer(1)
    set_precision(cfg, "mxfp8")
    layer.realign()
    layer.experts.quantization_padding = te_pad = ReferencePadding(32)  # as an fp8 build has
    layer.experts.quantization_unpadding = te_unpad = ReferenceUnpadding(32)
    tell_experts_groups_are_aligned(layer.experts, layer.token_dispatcher.aligner)
    res["inactive_kept"] = (
        layer.experts.quantization_padding is te_pad
        and layer.experts.quantization_unpadding is te_unpad
    )
    got = fwd_bwd(layer)
    res["inactive_calls"] = te_pad.calls
    res["inactive_bitwise"] = _bitwise(got, ref)
    res["inactive_groups"] = groups[-1]

    # The same with the aligner active: swapped, TE's padding kept only as the fallback.
    layer, cfg, groups = aligned_layer(None)
    set_precision(cfg, "mxfp8")
    layer.realign()
    layer.experts.quantization_padding = te_pad = ReferencePadding(32)
    tell_experts_groups_are_aligned(layer.experts, layer.token_dispatcher.aligner)
    pad = layer.experts.quantization_padding
    res["active_swapped"] = isinstance(pad, AlreadyAlignedPadding) and pad.fallback is te_pad
    got = fwd_bwd(layer)
    res["active_calls"] = te_pad.calls
    res["active_bitwise"] = _bitwise(got, ref)
    res["active_groups"] = groups[-1]

    # A bf16 build (no TE padding) that later runs fp8 with the aligner inactive: refused, not
    # passed through unaligned.
    layer, cfg, _ = aligned_layer(1)
    set_precision(cfg, "mxfp8")
    layer.realign()
    try:
        fwd_bwd(layer)
        res["inactive_no_fallback"] = "passed"
    except ValueError as e:
        res["inactive_no_fallback"] = str(e)

    # Our multiple 16 under mxfp8 (Megatron needs 32): the stand-in checks Megatron's multiple.
    layer, cfg, groups = aligned_layer(16)
    set_precision(cfg, "mxfp8")
    layer.realign()
    try:
        fwd_bwd(layer)
        res["weaker_multiple"] = "passed"
    except AssertionError as e:
        res["weaker_multiple"] = str(e)

    # Built from a spec in a user's own script, with what pretrain_gpt would refuse at argument
    # time: the layer refuses at construction (the config already says fp8/fp4), not mid-run.
    def construct(*args, **kwargs) -> str:
        try:
            aligned_layer(*args, **kwargs)
            return "built"
        except ValueError as e:  # ours, raised before Megatron's MoELayer is built
            return str(e)
        except AssertionError as e:  # Megatron's experts, past our check: fp8 needs TE to build
            assert "requires TE" in str(e), e
            return "past our check"

    res["construct"] = {
        "mxfp8_override_16": construct(16, "mxfp8"),
        "mxfp8_override_64": construct(64, "mxfp8"),
        "nvfp4_override_64": construct(64, "nvfp4"),
        "bf16_override_16": construct(16),
        "router_padding": construct(None, "fp8", moe_router_padding_for_quantization=True),
        "capacity_padding": construct(
            None, "fp8", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
        ),
    }
    return res


def _load_metric_checks() -> dict:
    from megatron_ext.common.micro_batch import MicroBatchContext
    from megatron_ext.moe.layer_specs import get_aligned_gpt_layer_local_spec
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(S).expand(B, S)
    recompute = {
        "none": {},
        "full": {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        },
        "moe_selective": {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    }
    res: dict = {}
    for name, overrides in recompute.items():
        micro_batches = MicroBatchContext()  # begun as the forward step does
        metrics = ExpertLoadMetrics(num_experts=8, micro_batches=micro_batches)
        alignment = MoEAlignmentConfig(moe_dispatch_align=True)
        cfg = tiny_moe_config(**overrides)
        model = build_tiny_gpt(
            cfg, layer_spec=get_aligned_gpt_layer_local_spec(alignment, 8, load_metrics=metrics)
        )
        moe_layers = [m for m in model.modules() if hasattr(m, "load_metrics")]
        router_calls = [0]
        for m in moe_layers:
            m.router.register_forward_hook(
                lambda *a, calls=router_calls: calls.__setitem__(0, calls[0] + 1)
            )
        micro_batches.attach(model)
        model.train()
        micro_batches.begin((0, 0))
        model(tokens, pos, None, labels=tokens).float().mean().backward()
        train, train_router_calls = metrics.summary(), router_calls[0]
        with torch.no_grad():  # train mode, an evaluation micro-batch (no grad in the step)
            micro_batches.begin(("eval", 1), training=False)
            model(tokens, pos, None, labels=tokens)
        model.eval()
        with torch.no_grad():  # Megatron's evaluate(): eval mode and no_grad
            micro_batches.begin(("eval", 2), training=False)
            model(tokens, pos, None, labels=tokens)
        res[name] = {
            "moe_recompute": [m.moe_layer_recompute for m in moe_layers],
            "recompute_granularity": cfg.recompute_granularity,
            "router_calls": train_router_calls,
            "eval_router_calls": router_calls[0] - train_router_calls,
            "moe_layers": len(moe_layers),
            "train": {k: v for k, v in train.items() if k.endswith("/tokens")},
            "after_eval": {k: v for k, v in metrics.summary().items() if k.endswith("/tokens")},
        }
    return res


@pytest.fixture(scope="module")
def padding_results():
    (res,) = run_distributed(_padding_checks, 1)
    return res


def test_inactive_aligner_keeps_megatrons_padding(padding_results):
    r = padding_results
    assert r["inactive_kept"] and r["inactive_calls"] > 0
    assert all(n % 32 == 0 for n in r["inactive_groups"])  # TE's padding aligned them
    assert r["inactive_bitwise"]  # fp32, zero pad rows: output and every grad bitwise (measured)


def test_active_aligner_swaps_padding_for_checked_pass_through(padding_results):
    r = padding_results
    assert r["active_swapped"] and r["active_calls"] == 0  # the fallback was not needed
    assert all(n % 32 == 0 for n in r["active_groups"]) and r["active_bitwise"]


def test_inactive_aligner_without_padding_refuses(padding_results):
    assert "inactive" in padding_results["inactive_no_fallback"]


def test_pass_through_checks_megatrons_multiple(padding_results):
    assert "multiple 32" in padding_results["weaker_multiple"]


def test_layer_refuses_at_construction_what_the_arguments_refuse(padding_results):
    r = padding_results["construct"]
    # Weaker than the recipe's multiple: refused naming the override, the recipe and its multiple.
    assert "--moe-dispatch-align-size 16 under --fp8-recipe mxfp8" in r["mxfp8_override_16"]
    assert "multiple of 32" in r["mxfp8_override_16"]
    assert "--moe-dispatch-align-size 64 under --fp4-recipe nvfp4" in r["nvfp4_override_64"]
    assert "multiple of 128" in r["nvfp4_override_64"]
    # A stronger multiple passes (Megatron's own experts then need TE for fp8), and any
    # override under bf16 (no padding at all) builds.
    assert r["mxfp8_override_64"] in ("past our check", "built")  # built where TE is installed
    assert r["bf16_override_16"] == "built"
    assert "--moe-router-padding-for-quantization" in r["router_padding"]
    assert "--moe-pad-expert-input-to-capacity" in r["capacity_padding"]


def test_load_metrics_count_each_training_micro_batch_once():
    (res,) = run_distributed(_load_metric_checks, 1)
    for name, r in res.items():
        assert r["moe_layers"] == 2, r
        # The recompute really happened: the router ran twice per layer under checkpointing.
        assert r["router_calls"] == (1 if name == "none" else 2) * r["moe_layers"], (name, r)
        if name == "moe_selective":
            assert all(r["moe_recompute"])
        if name == "full":
            assert r["recompute_granularity"] == "full"
        assert sorted(r["train"]) == ["layer1/tokens", "layer2/tokens"], (name, r)
        for layer, counts in r["train"].items():
            # One training forward of B*S tokens, top-2: each micro-batch counted exactly once.
            assert sum(counts) == B * S * TOPK, (name, layer, counts)
        assert r["eval_router_calls"] == 2 * r["moe_layers"]  # both evaluation forwards ran
        assert r["after_eval"] == r["train"], (name, r)  # ... and were not counted
