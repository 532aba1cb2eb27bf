"""Tier: Megatron's argument parser on one process. ``--cpu`` refuses, at argument time, what needs a GPU,
naming the flag; a CPU-runnable configuration passes; fp8 under --cpu needs the aligned grouped-GEMM path."""

import argparse
import sys

import pytest

from megatron_ext.training.cpu_args import check_cpu_args

OK = dict(transformer_impl="local", distributed_backend="gloo", cuda_graph_impl="none")


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"transformer_impl": "transformer_engine"}, "--transformer-impl transformer_engine"),
        ({"distributed_backend": "nccl"}, "--distributed-backend nccl"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local"),
        ({"enable_cuda_graph": True}, "--enable-cuda-graph"),
        ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
        ({"te_rng_tracker": True}, "--te-rng-tracker"),  # Megatron's dest for it
        ({"ckpt_fully_parallel_load": True}, "--ckpt-fully-parallel-load"),
        ({"async_save": True}, "--async-save"),
        ({"fp8": "e4m3", "moe_grouped_gemm": True}, "--moe-dispatch-align"),
        ({"fp4": "e2m1", "moe_dispatch_align": True}, "--moe-grouped-gemm"),
        ({"bf16": True}, "--bf16"),
        ({"fp16": True}, "--fp16"),
        ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type flex"),
        ({"moe_permute_fusion": True}, "--moe-permute-fusion"),
        ({"multi_latent_attention": True}, "--multi-latent-attention"),
        ({"mtp_num_layers": 1}, "--mtp-num-layers"),
        ({"fp4_param_gather": True}, "--fp4-param-gather"),
        ({"use_distributed_optimizer": True}, "--use-distributed-optimizer"),
        (  # the CPU grouped-GEMM experts are not sharded over expert-TP ranks
            {"moe_grouped_gemm": True, "num_experts": 8, "expert_tensor_parallel_size": 2},
            "--expert-tensor-parallel-size 1 (got 2",
        ),
        (  # before validate_args fills it in, expert TP is the TP size
            {"moe_grouped_gemm": True, "num_experts": 8, "tensor_model_parallel_size": 2},
            "--expert-tensor-parallel-size 1 (got 2",
        ),
        # --cpu with CP > 1: what its context-parallel attention stand-in does not model.
        (
            {"context_parallel_size": 2, "hybrid_context_parallel": True},
            "--hybrid-context-parallel",
        ),
        ({"context_parallel_size": 2, "cp_comm_type": ["a2a"]}, "--cp-comm-type a2a"),
        (
            {"context_parallel_size": 2, "hierarchical_context_parallel_sizes": [2, 1]},
            "--hierarchical-context-parallel-sizes",
        ),
        ({"context_parallel_size": 2, "softmax_type": "learnable"}, "--softmax-type learnable"),
        ({"context_parallel_size": 2, "window_size": (4, 0)}, "--window-size"),
        ({"context_parallel_size": 2, "position_embedding_type": "rope"}, "--pack-documents"),
    ],
)
def test_refused_naming_the_flag(change, flag):
    with pytest.raises(ValueError, match="--cpu") as err:
        check_cpu_args(argparse.Namespace(**{**OK, **change}))
    assert flag in str(err.value)


def test_cpu_runnable_configuration_passes():
    check_cpu_args(argparse.Namespace(**OK))
    # CP = 2 on packed samples (per-document split, the CPU context-parallel attention).
    check_cpu_args(
        argparse.Namespace(
            **OK, context_parallel_size=2, position_embedding_type="rope", pack_documents=True
        )
    )
    # TP=2 + sequence parallelism runs too (megatron_ext's SP local norms; test_real_loop_features
    # trains it).
    check_cpu_args(argparse.Namespace(**OK, sequence_parallel=True, tensor_model_parallel_size=2))
    check_cpu_args(
        argparse.Namespace(**OK, fp8="e4m3", moe_dispatch_align=True, moe_grouped_gemm=True)
    )
    # TP=2 with grouped-GEMM experts runs when expert TP is 1.
    grouped = dict(moe_grouped_gemm=True, num_experts=8, tensor_model_parallel_size=2)
    check_cpu_args(argparse.Namespace(**OK, **grouped, expert_tensor_parallel_size=1))


def test_megatrons_parser_default_transformer_engine_is_refused(monkeypatch):
    """Through Megatron's real parser: its default --transformer-impl is transformer_engine."""
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args

    argv = ["x", "--cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(ValueError, match="--cpu cannot run --transformer-impl transformer_engine"):
        configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))


def test_every_gpu_only_row_reads_its_flags_dest():
    """Each refused flag is read at the dest Megatron's parser stores it under (a row reading
    another name would never refuse: ``--te-rng-tracker`` is ``te_rng_tracker``)."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_ext.training.cpu_args import _GPU_ONLY

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dest_of = {option: a.dest for a in parser._actions for option in a.option_strings}
    assert {dest: dest_of.get(flag.split()[0]) for dest, _, flag, _ in _GPU_ONLY} == {
        dest: dest for dest, _, _, _ in _GPU_ONLY
    }
