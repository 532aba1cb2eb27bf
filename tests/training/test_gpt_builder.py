"""Tests for megatron_ext.training.gpt_builder. Tier: Megatron on one gloo rank (real GPTModel built
by megatron-core 0.19.2's ``GPTModelBuilder`` and by megatron_ext's builder, compared).

megatron-core 0.18.2 has no ``megatron.training.models.gpt``: megatron_ext's builder stands in there.
Here, on the installed 0.19.2, both build from the same arguments: the same config fields, the same
modules and, from the same seed, the same initial weights (MoE and dense, local modules). On
0.18.2 the real-loop tests build with it (make test-megatron-0.18.2).
"""

import argparse

import pytest
import torch

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.testing import run_distributed
from megatron_ext.training import gpt_builder

#: The Megatron arguments both ``gpt_config_from_args`` read (a parsed run's values).
ARGS = dict(
    spec=None, yaml_cfg=None, fp16_lm_cross_entropy=False, position_embedding_type="rope",
    rotary_percent=0.5, rotary_base=500, make_vocab_size_divisible_by=128, use_rope_scaling=False,
    rotary_seq_len_interpolation_factor=None, max_position_embeddings=64,
    untie_embeddings_and_output_weights=True, padded_vocab_size=256, vocab_size=250,
)  # fmt: skip

megatron_builder = pytest.mark.skipif(
    not gpt_builder.has_megatron_gpt_builder(),
    reason="compares with megatron-core 0.19's own GPT builder",
)


@megatron_builder
def test_the_config_reads_the_arguments_as_megatrons() -> None:
    from megatron.training.argument_utils import gpt_config_from_args

    # The transformer config is passed through (a stand-in: its fields are not read here).
    args, transformer = argparse.Namespace(**ARGS), argparse.Namespace()
    ours = gpt_builder.gpt_config_from_args(args, transformer)
    theirs = gpt_config_from_args(args, transformer)
    assert theirs.should_pad_vocab is False  # the padded size, as ours takes it
    for field in ours.__dataclass_fields__:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rotary_base == 500 and not ours.share_embeddings_and_output_weights  # not defaults


def _build_both(moe: bool, mtp: bool) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from megatron_ext.testing import tiny_moe_config

    overrides = {} if moe else {"num_moe_experts": None}
    overrides |= {"mtp_num_layers": 1} if mtp else {}
    built = {}
    for name, (config_class, builder_class) in {
        "megatron": (GPTModelConfig, GPTModelBuilder),
        "ours": (gpt_builder.GPTConfig, gpt_builder.GPTBuilder),
    }.items():
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0, force_reset_rng=True)
        config = config_class(
            transformer=tiny_moe_config(transformer_impl="local", **overrides), vocab_size=256,
            seq_length=64, position_embedding_type="rope",
        )  # fmt: skip
        model = builder_class(config).build_model(ProcessGroupCollection.use_mpu_process_groups())
        built[name] = {
            "modules": [(n, type(m).__name__) for n, m in model.named_modules()],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return built


@megatron_builder
@pytest.mark.parametrize(("moe", "mtp"), [(True, False), (False, True)])
def test_the_model_is_megatrons(moe: bool, mtp: bool) -> None:
    (built,) = run_distributed(_build_both, 1, moe, mtp)
    megatron, ours = built["megatron"], built["ours"]
    assert ours["modules"] == megatron["modules"]
    kinds = {kind for _, kind in ours["modules"]}
    assert ("MoELayer" in kinds) == moe and ("MultiTokenPredictionBlock" in kinds) == mtp, kinds
    assert ours["params"].keys() == megatron["params"].keys()
    for name, weight in ours["params"].items():
        assert torch.equal(weight, megatron["params"][name]), name


@pytest.mark.each_megatron
@pytest.mark.parametrize("flag", ["heterogeneous_layers_config_path", "yaml_cfg"])
def test_what_it_does_not_build_is_refused_without_megatrons_builder(monkeypatch, flag) -> None:
    view = MegatronView(**{flag: "model.yaml"})
    monkeypatch.setattr(gpt_builder, "has_megatron_gpt_builder", lambda: False)  # as on 0.18.2
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} needs megatron-core 0.19.2"):
        gpt_builder.check_gpt_builder(view)
    gpt_builder.check_gpt_builder(MegatronView(**{flag: "x", "hybrid_layer_pattern": "*E"}))
    gpt_builder.check_gpt_builder(MegatronView())  # a plain GPT model: built here
    monkeypatch.undo()
    if gpt_builder.has_megatron_gpt_builder():
        gpt_builder.check_gpt_builder(view)  # Megatron's own builder reads it
    else:  # the installed megatron-core is 0.18.2
        with pytest.raises(ValueError, match="needs megatron-core 0.19.2"):
            gpt_builder.check_gpt_builder(view)
