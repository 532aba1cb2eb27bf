"""Tier: Megatron on one process (``megatron_ext.pretrain_gpt.main --dry-run`` in this process, a world
of 2 ranks on PyTorch's ``fake`` backend while the model is built).

The dry run builds the model on the meta device for rank 0 and, under pipeline parallelism, the last
rank, and leaves no process group or patch behind. What it refuses, beside the launch:
test_startup_refusals.py.
"""

import json

import torch

from tests.training.entry_args import dry_run_main

EVAL = ["--eval-iters", "0", "--eval-interval", "9"]


def _resolved(out: str) -> dict:
    start = out.index("megatron_ext resolved configuration:\n") + len(
        "megatron_ext resolved configuration:\n"
    )
    return json.loads(out[start : out.index("megatron_ext: dry run OK")])


def test_every_pipeline_stage_is_built_on_the_meta_device(data_prefix, monkeypatch, capsys):
    argv = ["--data-path", data_prefix, *EVAL]
    assert dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err[-2000:]
    single = _resolved(capsys.readouterr().out)["built_on_meta_device"]
    pp2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "1"]
    assert dry_run_main([*argv, *pp2], monkeypatch) == 0, capsys.readouterr().err[-2000:]
    staged = _resolved(capsys.readouterr().out)["built_on_meta_device"]
    assert list(single) == ["rank 0"] and list(staged) == ["rank 0", "rank 1"]
    counts = {rank: int(stages[0].split("(")[1].split()[0]) for rank, stages in staged.items()}
    assert all(s.startswith("GPTModel (") for stages in staged.values() for s in stages)
    # One layer per stage: the first holds the embedding, the last the output layer's copy of it
    # and the final norm, so the two differ.
    assert counts["rank 0"] > 0 and counts["rank 1"] > 0 and counts["rank 0"] != counts["rank 1"]
    assert not torch.distributed.is_initialized()  # the fake world is gone


def test_transformer_engine_modules_are_not_built_without_it(data_prefix, monkeypatch, capsys):
    import importlib.util

    argv = ["--data-path", data_prefix, *EVAL, "--transformer-impl", "transformer_engine"]
    assert dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err[-2000:]
    resolved = _resolved(capsys.readouterr().out)
    if importlib.util.find_spec("transformer_engine") is None:
        assert resolved["built_on_meta_device"].startswith("not built here")
        assert resolved["transformer_engine"].startswith("not installed here")
    else:
        assert "rank 0" in resolved["built_on_meta_device"]


def test_the_target_assumption_holds_only_within_the_block() -> None:
    import importlib.util

    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import transformer_config

    from megatron_ext.training.dry_run import target

    before = transformer_config.is_te_min_version, rope_utils.fused_apply_rotary_pos_emb
    with target(False) as assumed:
        assert assumed == {}
        assert transformer_config.is_te_min_version is before[0]
    with target(True) as assumed:
        if importlib.util.find_spec("transformer_engine") is None:
            assert transformer_config.is_te_min_version("99.0")
            assert rope_utils.fused_apply_rotary_pos_emb is not None
            assert "transformer_engine" in assumed
    assert (transformer_config.is_te_min_version, rope_utils.fused_apply_rotary_pos_emb) == before
