"""Tier: Megatron's argument parser on one process (``parse_args``, then ``configs_from_args``).

What ``megatron_ext.pretrain_gpt`` cannot run is refused at argument time, naming the flag:
``megatron_ext.training.launch_rules`` (what context parallelism cannot split, record mode's one data prefix, the
Megatron flags and combinations the entry would crash on, hang on or silently ignore); and, among
the same configs' checks, ``ReplayConfig``'s check of a route file's header against the model
(L, K, E): a file written for another model is refused, the matching model passes.
"""

import sys

import pytest

from tests.training.entry_args import BASE_ARGS, EXPERTS, NUM_LAYERS, REPLAY_ARGS


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ([], None),  # plain CP is accepted: the forward step splits with Megatron's own function
        (["--hybrid-context-parallel"], "--hybrid-context-parallel is not supported"),
        (["--dataloader-inter-document-masking"], "--dataloader-inter-document-masking is not"),
    ],
)
def test_context_parallelism_refuses_what_it_cannot_split(monkeypatch, extra, match) -> None:
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    argv = ["pretrain_gpt", *BASE_ARGS, "--context-parallel-size", "2", *extra]
    monkeypatch.setattr(sys, "argv", argv)
    args = parse_args(extra_args_provider=add_megatron_ext_args)
    if match is None:
        assert configs_from_args(args)
        return
    with pytest.raises(ValueError, match=match):
        configs_from_args(args)


def test_record_mode_needs_one_data_prefix(monkeypatch, tmp_path, data_prefix) -> None:
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    argv = [
        *BASE_ARGS,
        "--pack-documents",
        "--route-replay-mode",
        "record",
        "--route-record-path",
        str(tmp_path / "r"),
        "--data-path",
        "0.5",
        data_prefix,
        "0.5",
        data_prefix + "_routes",  # an existing second prefix: the count is what is refused
    ]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *argv])
    with pytest.raises(ValueError, match="exactly one --data-path prefix"):
        configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm"),
        (["--sft"], "--sft needs --tokenizer-type SFTTokenizer"),
        (["--fim-data"], "--fim-data"),
        (["--dataloader-fast-cache-load"], "--dataloader-fast-cache-load"),
        (["--rampup-batch-size", "4", "4", "16"], "--rampup-batch-size: Megatron-Core 0.19.2"),
        (
            ["--moe-router-load-balancing-type", "quantile_balancing"],
            "quantile_balancing is not supported",
        ),
        (
            ["--mock-data", "--pack-documents", "--pad-to-seq-len"],
            "--mock-data cannot be combined with --pack-doc",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--route-replay-mode",
                "record",
                "--route-record-path",
                "/tmp/never-written",
                "--pack-documents",
                "--pad-to-seq-len",
                "--data-path",
                "P",
            ],
            "record with --pipeline-model-parallel-size > 1",
        ),
        (
            [
                "--pack-documents",
                "--eval-micro-batch-size",
                "2",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "4",
                "--data-path",
                "P",
            ],
            "--eval-micro-batch-size 1",
        ),
        (["--mtp-num-layers", "1", "--moe-dispatch-align"], "--mtp-num-layers with --moe-disp"),
        (["--train-iters", "0"], "--train-iters must be at least 1, got 0"),
        (
            [
                "--mtp-num-layers",
                "1",
                "--moe-router-enable-expert-bias",
                "--moe-router-score-function",
                "sigmoid",
            ],
            "--mtp-num-layers with --moe-router-enable-expert-bias",
        ),
        (
            [
                "--mtp-num-layers",
                "1",
                "--route-replay-mode",
                "replay",
                "--pack-documents",
                "--pad-to-seq-len",
                "--route-data-suffix",
                "_routes",
                "--data-path",
                "P",
            ],
            "--mtp-num-layers with --route-replay-mode",
        ),
    ],  # fmt: skip
)
def test_what_the_entry_cannot_run_is_refused_at_argument_time(
    monkeypatch, data_prefix, extra: list[str], match: str
) -> None:
    """Megatron accepts each, and each crashed, hung or was silently ignored later in a run."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    if "quantile_balancing" in extra and not hasattr(TopKRouter, "quantile_balancing"):
        pytest.skip("megatron-core 0.18.2's parser has no quantile_balancing")
    extra = [data_prefix if a == "P" else a for a in extra]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *BASE_ARGS, *extra])
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(extra_args_provider=add_megatron_ext_args)
    with pytest.raises(ValueError, match=match):
        configs_from_args(args)


@pytest.mark.parametrize(
    "change, model",
    [
        (["--num-experts", str(2 * EXPERTS)], f"over {2 * EXPERTS} experts"),
        (["--moe-router-topk", "1"], "x top-1 over"),
        (["--num-layers", str(2 * NUM_LAYERS)], f"the model has {2 * NUM_LAYERS} MoE layers"),
    ],
)
def test_a_route_file_for_another_model_is_refused_at_argument_time(
    monkeypatch, data_prefix, change: list[str], model: str
) -> None:
    """The header's L, K, E are checked when arguments are parsed, not at dataset build after
    the model and optimizer exist; the matching model passes."""
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    argv = [*BASE_ARGS, *REPLAY_ARGS, "--data-path", data_prefix]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *argv])
    configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))  # the same model
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *argv, *change])
    with pytest.raises(ValueError, match=rf"was written for {NUM_LAYERS} MoE layers .*{model}"):
        configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))


def test_megatron_ignores_rampup_batch_size_so_the_entry_refuses_it() -> None:
    """Why ``--rampup-batch-size`` is refused: Megatron-Core 0.19.2's calculator takes it and keeps
    the full global batch from the first sample (its training loop does not even pass it). Should
    a later Megatron ramp again, this fails and the refusal must be revisited."""
    from megatron.core import num_microbatches_calculator as nmc

    saved = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    try:
        nmc.init_num_microbatches_calculator(
            rank=1,  # no deprecation warning in the test log
            rampup_batch_size=[4, 4, 16],
            global_batch_size=8,
            micro_batch_size=2,
            data_parallel_size=1,
        )
        nmc.update_num_microbatches(consumed_samples=0, consistency_check=False)
        assert nmc.get_current_global_batch_size() == 8  # a ramp would start at 4
        assert nmc.get_num_microbatches() == 4
    finally:
        nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = saved
