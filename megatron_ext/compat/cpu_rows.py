"""The compatibility table's CPU rows: what ``--cpu``, the tests and the demo change in Megatron-Core
0.19.2 so its real MoE stack (``cpu.*`` groups) and training loop (``cpu_loop.*`` groups) run on CPU
over gloo. Each :class:`HostTorch` row changes the named ``torch`` calls of one function, nothing else
in its module; the factories named in ``replacement`` live in :mod:`megatron_ext.cpu.model_stack` and
:mod:`megatron_ext.cpu.training_loop`, beside their reasons. None changes numerics.
"""

from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Needs, Patch

# The torch.cuda names rerouted together: a function ordering work on streams uses several of them,
# and on the host every one is a no-op (CPU work is already ordered).
STREAMS = ("Stream", "Event", "current_stream", "stream", "synchronize")
# What the training loop's bookkeeping (timers, memory reports) asks of the device.
_LOOP = ("current_device", "synchronize", "empty_cache")
# The CUDA generator's state, which the CPU generator stands in for (as in model_stack).
_RNG = ("get_rng_state", "set_rng_state")


def _host_rows(
    *,
    group: str,
    module: str,
    replacement: HostTorch,
    reason: str,
    fingerprints: dict[str, str | dict[str, str]],
    only: dict[str, tuple[str, ...]] | None = None,
) -> list[Patch]:
    """One :class:`HostTorch` row per function of ``module`` (``{attribute: fingerprint}``, one
    fingerprint for every version or ``{version: fingerprint}``), the rest of each row shared;
    ``only``: the versions of a function that is not there on every supported one."""
    only = only or {}
    # One row per function, not per module: the check and the triage read each function alone.
    return [
        Patch(group=group, module=module, attribute=attribute, replacement=replacement,
              reason=reason, fingerprint=fingerprint,
              **({"versions": only[attribute]} if attribute in only else {}))
        for attribute, fingerprint in fingerprints.items()
    ]  # fmt: skip


M = "megatron.core."
T = "megatron.training."
CPU = "megatron_ext.cpu.model_stack:"
LOOP = "megatron_ext.cpu.training_loop:"

CPU_ROWS: list[Patch] = [
    Patch(
        group="cpu.rng_tracker", module=M + "tensor_parallel.random",
        attribute="_get_cuda_rng_state", replacement=CPU + "cpu_rng_state",
        reason="reads CUDA RNG state (fork, checkpointing): the CPU generator instead",
        fingerprint="de1366f01102a03f",
    ),
    Patch(
        group="cpu.rng_tracker", module=M + "tensor_parallel.random",
        attribute="_set_cuda_rng_state", replacement=CPU + "set_cpu_rng_state",
        reason="writes CUDA RNG state: the CPU generator instead", fingerprint="5a49a6e91b14818e",
    ),
    *_host_rows(
        group="cpu.rng_tracker", module=M + "tensor_parallel.random",
        replacement=HostTorch(cuda=(*_RNG, "manual_seed")),
        reason="per-TP/EP-rank seeding and forked streams seed and read the CUDA generator",
        fingerprints={
            "CudaRNGStatesTracker.add": "9e37f32a754ae1b8",
            "model_parallel_cuda_manual_seed": "b9c06dfe827c3aa2",
        },
    ),
    *_host_rows(
        group="cpu.null_streams", module=M + "transformer.moe.token_dispatcher",
        replacement=HostTorch(cuda=STREAMS),
        reason="a side stream for the batched device-to-host copies of the all-to-all splits",
        fingerprints={
            "MoEAlltoAllTokenDispatcher.__init__": "9e8007d08e514b3b",
            "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize": "d1fb25bde2c98026",
        },
    ),
    *_host_rows(
        group="cpu.null_streams", module=M + "distributed.param_and_grad_buffer",
        replacement=HostTorch(cuda=STREAMS),
        reason="DDP orders its gradient all-reduce against the current CUDA stream",
        fingerprints={
            "_ParamAndGradBucketGroup.start_grad_sync": {"0.18.2": "d9ba313ae96f164d",
                                                       "0.19.2": "9a97123a8533faf3"},
            "_ParamAndGradBucketGroup.finish_grad_sync": "31be343dc9a98d4e",
        },
    ),
    *_host_rows(
        group="cpu.null_streams", module=M + "transformer.moe.shared_experts",
        replacement=HostTorch(cuda=STREAMS),
        reason="--moe-shared-expert-overlap runs the shared experts on a side CUDA stream",
        fingerprints={
            "_BackwardStreamWait.backward": "2cf227ed89802b84",
            "SharedExpertMLP.__init__": {"0.18.2": "98ed03c79460124d", "0.19.2": "b940156246897d1d"},
            "SharedExpertMLP.wait_current_stream": "5ed1b87063e9df7c",
            "SharedExpertMLP.pre_forward_comm": "e58f10a30fa87464",
            "SharedExpertMLP.linear_fc1_forward_and_act": "e58f10a30fa87464",
            "SharedExpertMLP.linear_fc2_forward": "e58f10a30fa87464",
            "SharedExpertMLP.post_forward_comm": "e58f10a30fa87464",
            "SharedExpertMLP.get_output": "2a361f4186b8da09",
            "FusedSharedExpertMLP.linear_fc1_forward_and_act": "e58f10a30fa87464",
        },
        # FusedSharedExpertMLP was added after 0.18.2.
        only={"FusedSharedExpertMLP.linear_fc1_forward_and_act": ("0.19.2",)},
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "pipeline_parallel.p2p_communication",
        replacement=HostTorch(cuda=(*STREAMS, "current_device")),
        reason="pipeline receive buffers on the current CUDA device; synchronize after send/recv",
        fingerprints={
            "P2PCommunicator._communicate_shapes": "ee0cc8fb8ec43d0a",
            "P2PCommunicator._communicate": "d57c8bb1fe2c07f1",
        },
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "transformer.moe.router",
        replacement=HostTorch(cuda=("current_device",)),
        reason="router weights and aux-loss / expert-bias buffers moved to the current CUDA "
               "device",
        fingerprints={
            "Router.gating": "ce6c2be554547dc2",
            "TopKRouter.__init__": {"0.18.2": "30fe54268e341770", "0.19.2": "847894ef2e08c2f9"},
        },
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "models.common.embeddings.rotary_pos_embedding",
        replacement=HostTorch(cuda=("current_device",)),
        reason="inv_freq placed on the current CUDA device",
        fingerprints={
            "RotaryEmbedding.__init__": "1df6f21e70c44c53",
            "RotaryEmbedding.get_emb": "79bc993836b95a61",
            "MultimodalRotaryEmbedding.__init__": "1619faf194bba9f0",
        },
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "utils",
        replacement=HostTorch(cuda=("current_device",)),
        reason="scratch buffers and broadcast batches on the current CUDA device",
        fingerprints={
            "GlobalMemoryBuffer.get_tensor": "37b46187c8687035",
            "StragglerDetector.configure": "64a59ba3f4194114",
            "get_batch_on_this_tp_rank": {"0.18.2": "6791d5a9bbfa940c",
                                          "0.19.2": "c0f3e6393bd5c9cc"},
        },
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "tensor_parallel.mappings",
        replacement=HostTorch(cuda=("current_device",)),
        reason="TP/EP gather, reduce-scatter and all-to-all outputs on the current CUDA device",
        fingerprints={
            "_gather_along_last_dim": "24bc5a8163af6f25",
            "_gather_along_first_dim": "134fb51b273a6356",
            "_reduce_scatter_along_first_dim": "24bc5a8163af6f25",
            "_AllToAll.forward": "f1eb4a62a2cab13d",
        },
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "tensor_parallel.layers",
        replacement=HostTorch(cuda=("current_device",)),
        reason="TP layers' weights and sequence-parallel backward buffers on the current CUDA "
               "device",
        fingerprints={
            "VocabParallelEmbedding.__init__": "0f6799a4048669c0",
            "LinearWithGradAccumulationAndAsyncCommunication.backward": "617a2e3a6959b413",
            "ColumnParallelLinear.__init__": "ba499b8f6c6ee295",
            "RowParallelLinear.__init__": "187fcd81ca8e92e7",
        },
    ),
    *_host_rows(
        group="cpu.current_device", module=M + "distributed.param_and_grad_buffer",
        replacement=HostTorch(cuda=("current_device",)),
        reason="DDP gradient buffers on the current CUDA device",
        fingerprints={
            "_ParamAndGradBuffer.__init__": "ab01ecf87c1546f2",
        },
    ),
    Patch(
        group="cpu.split_sizes", module=M + "transformer.moe.moe_utils",
        attribute="maybe_move_tensor_to_cpu", replacement=CPU + "split_sizes_as_numpy",
        reason="converts only CUDA split sizes: gloo's all_to_all_single rejects the CPU tensors "
               "it leaves at EP >= 2",
        fingerprint="d48cb2407326de4b",
    ),
    Patch(
        group="cpu.split_sizes", module=M + "transformer.moe.token_dispatcher",
        attribute="maybe_move_tensor_to_cpu", replacement=CPU + "split_sizes_as_numpy",
        reason="the dispatcher's own import of the same function", fingerprint="d48cb2407326de4b",
    ),
    Patch(
        group="cpu.default_causal_mask", module=M + "fusions.fused_softmax",
        attribute="get_default_causal_mask", replacement=CPU + "causal_mask_on_host",
        reason="the local softmax's default causal mask has "
               "device=\"cuda\"", fingerprint="0a154dc8d30d1ba6",
    ),
    *_host_rows(
        group="cpu.schedule_buffers", module=M + "pipeline_parallel.schedules",
        replacement=HostTorch(factories=True),
        reason="the schedules' token counter is allocated with device=\"cuda\"",
        fingerprints={
            "forward_step": "585763aef20d0ec3",
            "forward_backward_no_pipelining": "39364e8e83adeb15",
            "forward_backward_pipelining_with_interleaving": "39364e8e83adeb15",
            "forward_backward_pipelining_without_interleaving": "39364e8e83adeb15",
        },
    ),
    Patch(
        group="cpu.checkpoint_without_output", module=M + "tensor_parallel.random",
        attribute="CheckpointWithoutOutput.__init__",
        replacement=CPU + "checkpoint_without_fp8_state",
        reason="fp8=False still sets self.fp8 (fp8 is not None): asks Transformer Engine, absent "
               "on CPU",
        depends_on=("fp8 is not None",), fingerprint="77372a149cf3adb8",
    ),
    Patch(
        group="cpu.te_partition", module=M + "utils", attribute="tex",
        replacement=CPU + "te_partition_stand_in",
        reason="a rehearsal stand-in: get_batch_on_this_cp_rank splits a packed micro-batch over "
               "the CP ranks with Transformer Engine's thd_get_partitioned_indices (tex is None "
               "without TE, and TE's kernel takes CUDA tensors): the pure-torch "
               "megatron_ext.common.thd_partition instead",
        fingerprint=Needs(("None", "module")),
    ),
]  # fmt: skip

LOOP_ROWS: list[Patch] = [
    *_host_rows(
        group="cpu_loop.initialize", module=T + "initialize",
        replacement=HostTorch(cuda=(*_LOOP, "device_count", "set_device"),
                    factories=True),
        reason="initialisation skips model parallelism and seeding without a CUDA device and "
               "places tensors on it",
        fingerprints={
            "initialize_megatron": "c200e93b2b7d3430",
            "_initialize_distributed": "a91bf896eab37d88",
            "_set_random_seed": "7d6fdbed55259f3e",
            "_warmup_jit_function": "b4a8a7deb5e886d8",
        },
    ),
    Patch(
        group="cpu_loop.initialize", module=T + "initialize", attribute="_warmup_jit_function",
        replacement=LOOP + "warmup_leaving_the_generator",
        reason="the JIT warm-up's random inputs (sized by --seq-length / CP / TP) come from the "
               "CPU generator standing in for CUDA's: the routers' initial weights would depend "
               "on the parallel layout",
        fingerprint={"0.18.2": "8d4f4af5ed689f6e", "0.19.2": "6309e1dddc2c502b"},
    ),
    Patch(
        group="cpu_loop.initialize", module=T + "training", attribute="initialize_megatron",
        replacement=LOOP + "allowing_no_cuda",
        reason="pretrain's initialize_megatron asserts CUDA unless allow_no_cuda",
        depends_on=("allow_no_cuda",), fingerprint="9ead1367c28de2ab",
    ),
    *_host_rows(
        group="cpu_loop.training", module=T + "training",
        replacement=HostTorch(cuda=(*_LOOP, "Stream", "current_stream",
                    "stream"), factories=True),
        reason="start-time all-reduces, loss dictionaries and data-loader flags on device=\"cuda\";"
               " synchronize / empty_cache; get_model's side stream",
        fingerprints={
            "update_seqlen_stats_from_cu_seqlens": "95798100ac67b6d5",
            "pretrain": "9d25dd9a13ff826f",
            "get_model": "7055fe72c8a7696d",
            "train_step": "0f1198c0530c7957",
            "training_log": "2e3af6928160a254",
            "save_checkpoint_and_time": "e2167366234935e1",
            "post_training_step_callbacks": "ec9a2c24c76143a3",
            "checkpoint_and_decide_exit": "03ea3a82b13f1f2a",
            "train": "abb637e3fe328d65",
            "evaluate": "83f283b158108289",
            "evaluate_and_print_results": "e8b85f9f8f68187f",
            "build_train_valid_test_data_loaders": "741f84a181ebe929",
            "build_train_valid_test_data_iterators": "d39d42eca95ca3fe",
        },
    ),
    Patch(
        group="cpu_loop.training", module=T + "training", attribute="get_model",
        replacement=LOOP + "model_left_on_host",
        reason="get_model moves each stage with "
               "model.cuda(current_device)", depends_on=(".cuda(",),
        fingerprint="aeceb50349c68e1c",
    ),
    *_host_rows(
        group="cpu_loop.timers", module=M + "timers",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="synchronize around timed regions; the all-gather buffer on the current device",
        fingerprints={
            "Timer.start": "193e9af8222a4985",
            "Timer.stop": "193e9af8222a4985",
            "Timers._get_elapsed_time_all_ranks": "86b8d3a16149a7bc",
        },
    ),
    *_host_rows(
        group="cpu_loop.optimizer", module=M + "optimizer.optimizer",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="loss-scale and found_inf buffers with device=\"cuda\"",
        fingerprints={
            "MegatronOptimizer.has_grad_norm_group": "5d8c5a1fe4d2c752",
            "MegatronOptimizer.offload_to_cpu": "e2167366234935e1",
            "MixedPrecisionOptimizer.__init__": "7b114b7ace23147b",
            "FP32Optimizer.__init__": "53b51070ca3c79d5",
            "ChainedOptimizer.get_loss_scale": "2f5bd36b600350b8",
        },
        # Separate gradient-norm groups (and has_grad_norm_group) came after 0.18.2.
        only={"MegatronOptimizer.has_grad_norm_group": ("0.19.2",)},
    ),
    *_host_rows(
        group="cpu_loop.rng_checkpoint", module=M + "rerun_state_machine",
        replacement=HostTorch(cuda=(*_LOOP, *_RNG),
                    factories=True),
        reason="the rerun state machine captures CUDA RNG state and reduces on the current device",
        fingerprints={
            "RerunStateMachine._reduce_any": "de5eb0b1cb82428c",
            "RerunStateMachine.validate_result": "9a4c5b2f0118bbdf",
            "RerunStateMachine._save_state": "9609eab7986b7dc1",
            "RerunStateMachine._restore_state": "762d2832b88a20d8",
            "RerunStateMachine._log_validation_error_to_file": "16e5efbed60c2449",
        },
    ),
    *_host_rows(
        group="cpu_loop.rng_checkpoint", module=T + "checkpointing",
        replacement=HostTorch(cuda=(*_LOOP, *_RNG),
                    factories=True),
        reason="checkpoints save and restore CUDA RNG state",
        fingerprints={
            "read_metadata": "060f18f3460d80c0",
            "get_rng_state": {"0.18.2": "d01ea0b192d9d480", "0.19.2": "53c8efafc8795f32"},
            "load_checkpoint": "e9a41e69786c378f",
        },
    ),
    Patch(
        group="cpu_loop.rng_checkpoint", module=T + "training",
        attribute="build_train_valid_test_data_iterators",
        replacement=LOOP + "iterators_leaving_the_generator",
        reason="with CUDA RNG on the CPU generator, data-loader seeds would move dropout's draws",
        fingerprint="e9cb1d9938fbbce7",
    ),
    *_host_rows(
        group="cpu_loop.checkpoint_dist",
        module=M + "dist_checkpointing.strategies.filesystem_async",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="torch_dist saves synchronize after copying to the host",
        fingerprints={
            "FileSystemWriterAsync.prepare_write_data": "39f5a4a38751487f",
            "FileSystemWriterAsync.preload_tensors": "193e9af8222a4985",
        },
    ),
    *_host_rows(
        group="cpu_loop.checkpoint_dist",
        module=M + "dist_checkpointing.strategies.state_dict_saver",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="the save's failure flag on the current device",
        fingerprints={
            "verify_global_md_reuse": "9db98f4868b4b8f0",
            "save_state_dict_async_finalize": "b7286e8c243c177f",
        },
    ),
    *_host_rows(
        group="cpu_loop.grad_norm", module=M + "optimizer.clip_grads",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="gradient norms allocated with device=\"cuda\"",
        fingerprints={
            "get_grad_norm_fp32": {"0.18.2": "8ec642bed3ed5124", "0.19.2": "cc6e9be7411f610a"},
            "count_zeros_fp32": "ec1fe0449e88d56c",
        },
    ),
    *_host_rows(
        group="cpu_loop.grad_norm", module=M + "utils",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="the local multi-tensor L2 norm returns its norm on \"cuda\"",
        fingerprints={
            "local_multi_tensor_l2_norm": "72982f1de13a0114",
            "StragglerDetector.elapsed": "274f7dfb65583eaf",
        },
    ),
    Patch(
        group="cpu_loop.grad_norm", module=M + "optimizer.clip_grads",
        attribute="clip_grad_by_total_norm_fp32", replacement=LOOP + "clip_by_total_norm",
        reason="asserts grad.type() == 'torch.cuda.FloatTensor': a copy of its body reads it as "
               "fp32",
        fingerprint="786426254ea8f52b",
    ),
    Patch(
        group="cpu_loop.grad_norm", module=M + "optimizer.optimizer",
        attribute="clip_grad_by_total_norm_fp32", replacement=LOOP + "clip_by_total_norm",
        reason="the optimizer's own import of the same function", fingerprint="786426254ea8f52b",
    ),
    *_host_rows(
        group="cpu_loop.common_utils", module=T + "utils.common_utils",
        replacement=HostTorch(cuda=_LOOP, factories=True),
        reason="parameter norms, loss averaging and max-stat reductions on \"cuda\"",
        fingerprints={
            "_compute_norm_2": "85d578259008e097",
            "calc_dtensor_params_l2_norm": "8d0ed32ad1d5a76d",
            "reduce_max_stat_across_model_parallel_group": "1579a7f30c61cc8f",
            "logical_and_across_model_parallel_group": "b00a0975cc41f663",
            "calc_params_l2_norm": "8de03172fa65d86e",
        },
        # 0.18.2 computes the norms inline in calc_params_l2_norm; 0.19.2 factored them out into
        # _compute_norm_2 (its calc_params_l2_norm makes no CUDA call of its own).
        only={"_compute_norm_2": ("0.19.2",), "calc_params_l2_norm": ("0.18.2",)},
    ),
]  # fmt: skip
