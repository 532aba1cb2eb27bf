"""Tier: Megatron on one rank (a gloo world of 1 where a process group is needed). The aligner's
multiple per Megatron config (decided once per layer, passed down), and its device-count
chunk-sort plan against the host-count one.

The aligner end to end inside both dispatchers is test_token_dispatcher.py.
"""

import pytest
import torch

from megatron_ext.testing import run_distributed

from .test_token_dispatcher import PRECISIONS, set_precision


@pytest.mark.parametrize("op_fuser", [False, True])
def test_align_size_for_config_leaves_bf16_untouched(op_fuser):
    """Megatron's get_align_size_for_quantization says 256 under the op fuser even for bf16; it
    only pads under fp8/fp4, and so do we: bf16 gives 0 (identity), fp8 gives Megatron's value."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.moe.config import align_size_for_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    cfg.use_transformer_engine_op_fuser = op_fuser  # set after build: no TE to validate it
    on = MoEAlignmentConfig(moe_dispatch_align=True)
    assert align_size_for_config(cfg, on) == 0
    assert (
        align_size_for_config(
            cfg, MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_size=256)
        )
        == 0
    )
    for precision in PRECISIONS:
        set_precision(cfg, precision)
        assert align_size_for_config(cfg, on) == get_align_size_for_quantization(cfg) > 1


def test_override_wins_only_under_fp8_fp4():
    """The override is ours (Megatron has no such rule): it wins under fp8/fp4, 0 or 1 disables,
    and without --moe-dispatch-align nothing aligns."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.moe.config import align_size_for_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    set_precision(cfg, "mxfp8")

    def align(**kw):
        return align_size_for_config(cfg, MoEAlignmentConfig(**kw))

    assert align(moe_dispatch_align=True) == 32  # Megatron's value
    assert align(moe_dispatch_align=True, moe_dispatch_align_size=64) == 64
    assert align(moe_dispatch_align=True, moe_dispatch_align_size=1) == 0
    assert align(moe_dispatch_align=False) == 0


def _decided_once() -> dict:
    """A layer's multiple is decided at construction and passed down; a precision changed later
    reaches the dispatcher only through realign()."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.testing import tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = tiny_moe_config()
    set_precision(cfg, "nvfp4")  # before construction (an fp4 config cannot be built without TE)
    spec = with_aligned_moe(
        get_gpt_layer_local_spec(num_experts=8), MoEAlignmentConfig(moe_dispatch_align=True)
    )
    layer = spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False)
    aligner = layer.token_dispatcher.aligner
    res = {"built": (layer.align, aligner.align)}
    set_precision(cfg, "fp8")
    res["changed"] = aligner.align
    res["realigned"] = (layer.realign(), aligner.align)
    return res


def test_multiple_is_decided_at_construction_and_passed_down():
    (res,) = run_distributed(_decided_once, 1)
    assert res == {"built": (128, 128), "changed": 128, "realigned": (16, 16)}, res


def _device_vs_host_chunk_counts() -> dict:
    """The aligner's two chunk-sort plans on the same received rows: counts on the host (a list:
    Megatron's copy) and counts left on the device (TE's fused permute; on a GPU only)."""
    from megatron_ext.moe.config import align_size_for_config
    from megatron_ext.moe.group_aligner import GroupAligner
    from megatron_ext.testing import tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = tiny_moe_config()
    set_precision(cfg, "fp8")
    g = torch.Generator().manual_seed(3)
    counts_RE = torch.randint(0, 9, (2, 4), generator=g)  # 2 source ranks x 4 local experts
    counts_RE[1, 2] = 0  # an empty chunk
    num_rows = int(counts_RE.sum())
    x = torch.randn(num_rows, 8, generator=g)
    probs = torch.rand(num_rows, generator=g)
    host_E = counts_RE.sum(0)
    res = {}
    for buffer in ("host_counts", "static_bound"):
        alignment = MoEAlignmentConfig(moe_dispatch_align=True, moe_dispatch_align_buffer=buffer)
        out = {}
        for kind, routing in (("host", counts_RE.tolist()), ("device", counts_RE)):
            align = align_size_for_config(cfg, alignment)  # 16: what the layer passes down
            aligner = GroupAligner(align, alignment.moe_dispatch_align_buffer)
            x_P, sizes_E, probs_P = aligner.pad(x, probs, routing, host_E)
            kind_of_layout = type(aligner.layout).__name__
            out[kind] = (x_P, sizes_E.tolist(), probs_P, aligner.strip(x_P * 2), kind_of_layout)
        (hx, hs, hp, hback, hkind), (dx, ds, dp, dback, dkind) = out["host"], out["device"]
        res[buffer] = {
            "kinds": (hkind, dkind),
            "equal": torch.equal(hx, dx) and hs == ds and torch.equal(hp, dp),
            "sizes": hs,
            "round_trip": torch.equal(hback, 2 * x) and torch.equal(dback, 2 * x),
            "pads": hx.shape[0] - num_rows,
        }
    return res


def test_device_chunk_counts_plan_the_same_buffer_as_host_counts():
    """The device-count branch (counts never copied to the host, as under TE's fused permute:
    unreachable through Megatron's dispatcher on CPU) lays out exactly what the host-count
    chunk sort does, and its strip restores the received rows."""
    (res,) = run_distributed(_device_vs_host_chunk_counts, 1)
    for buffer, r in res.items():
        assert r["kinds"] == ("ChunkLayout", "AlignedLayout"), r
        assert r["equal"] and r["round_trip"] and r["pads"] > 0, (buffer, r)
        assert all(n % 16 == 0 for n in r["sizes"]), r
