"""The compatibility table's CPU rows: what ``--cpu``, the tests and the demo change in Megatron-Core
0.19.2 so its real MoE stack (``cpu.*`` groups) and training loop (``cpu_loop.*`` groups) run on CPU
over gloo. Each :class:`HostTorch` row changes the named ``torch`` calls of one function, nothing else
in its module; the factories named in ``replacement`` live in :mod:`megatron_ext.cpu.model_stack` and
:mod:`megatron_ext.cpu.training_loop`, beside their docstrings. None changes numerics.
"""

from megatron_ext.compat.host_torch import HostTorch
from megatron_ext.compat.patch import Patch

STREAMS = ("Stream", "Event", "current_stream", "stream", "synchronize")
_LOOP = ("current_device", "synchronize", "empty_cache")
_RNG = ("get_rng_state", "set_rng_state")


def _rows(
    group: str, module: str, host: HostTorch, reason: str, fps: dict[str, str]
) -> list[Patch]:
    """One :class:`HostTorch` row per function of ``module`` (``{attribute: fingerprint}``)."""
    return [Patch(group, module, attr, host, reason, fp) for attr, fp in fps.items()]


def _one(group: str, module: str, attribute: str, factory: str, reason: str, fp: str) -> Patch:
    return Patch(group, module, attribute, factory, reason, fp)


M = "megatron.core."
T = "megatron.training."
CPU = "megatron_ext.cpu.model_stack:"
LOOP = "megatron_ext.cpu.training_loop:"

CPU_ROWS: list[Patch] = [
    _one("cpu.rng_tracker", M + "tensor_parallel.random", "_get_cuda_rng_state", CPU + "cpu_rng_state",
         "reads CUDA RNG state (fork, checkpointing): the CPU generator instead", "de1366f01102a03f"),
    _one("cpu.rng_tracker", M + "tensor_parallel.random", "_set_cuda_rng_state", CPU + "set_cpu_rng_state",
         "writes CUDA RNG state: the CPU generator instead", "5a49a6e91b14818e"),
    *_rows("cpu.rng_tracker", M + "tensor_parallel.random", HostTorch(cuda=(*_RNG, "manual_seed")),
           "per-TP/EP-rank seeding and forked streams seed and read the CUDA generator", {
               "CudaRNGStatesTracker.add": "8da82893ff102dd6",
               "model_parallel_cuda_manual_seed": "40faa191065121d1"}),
    *_rows("cpu.null_streams", M + "transformer.moe.token_dispatcher", HostTorch(cuda=STREAMS),
           "a side stream for the batched device-to-host copies of the all-to-all splits", {
               "MoEAlltoAllTokenDispatcher.__init__": "fe0fbc2b07889a17",
               "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize": "16d689899261ad81"}),
    *_rows("cpu.null_streams", M + "distributed.param_and_grad_buffer", HostTorch(cuda=STREAMS),
           "DDP orders its gradient all-reduce against the current CUDA stream", {
               "_ParamAndGradBucketGroup.start_grad_sync": "8686bdc99a75bc87",
               "_ParamAndGradBucketGroup.finish_grad_sync": "997baa31828cc388"}),
    *_rows("cpu.null_streams", M + "transformer.moe.shared_experts", HostTorch(cuda=STREAMS),
           "--moe-shared-expert-overlap runs the shared experts on a side CUDA stream", {
               "_BackwardStreamWait.backward": "aea249d024b7d8ae",
               "SharedExpertMLP.__init__": "d6fcc82621743c73",
               "SharedExpertMLP.wait_current_stream": "3f1b17c5087ff6df",
               "SharedExpertMLP.pre_forward_comm": "957d64575ca937e7",
               "SharedExpertMLP.linear_fc1_forward_and_act": "43b530a263b08ec3",
               "SharedExpertMLP.linear_fc2_forward": "471309f99d4f87f4",
               "SharedExpertMLP.post_forward_comm": "dff1146397c0128f",
               "SharedExpertMLP.get_output": "a7fb41b99e9d19a7",
               "FusedSharedExpertMLP.linear_fc1_forward_and_act": "ea064d56707e301f"}),
    *_rows("cpu.current_device", M + "pipeline_parallel.p2p_communication",
           HostTorch(cuda=(*STREAMS, "current_device")),
           "pipeline receive buffers on the current CUDA device; synchronize after send/recv", {
               "P2PCommunicator._communicate_shapes": "50581397092ea1c7",
               "P2PCommunicator._communicate": "9d9acc963c0f9589"}),
    *_rows("cpu.current_device", M + "transformer.moe.router", HostTorch(cuda=("current_device",)),
           "router weights and aux-loss / expert-bias buffers moved to the current CUDA device", {
               "Router.gating": "dd6bc5214864dbb4",
               "TopKRouter.__init__": "98b3f6afb64af96d"}),
    *_rows("cpu.current_device", M + "models.common.embeddings.rotary_pos_embedding",
           HostTorch(cuda=("current_device",)), "inv_freq placed on the current CUDA device", {
               "RotaryEmbedding.__init__": "50a8dbbe6e4ccbec",
               "RotaryEmbedding.get_emb": "d39f0bd2c2db4733",
               "MultimodalRotaryEmbedding.__init__": "8b136d6541ebc0c7"}),
    *_rows("cpu.current_device", M + "utils", HostTorch(cuda=("current_device",)),
           "scratch buffers and broadcast batches on the current CUDA device", {
               "GlobalMemoryBuffer.get_tensor": "467ee60cce19d324",
               "StragglerDetector.configure": "4d20bd5323e59aa7",
               "get_batch_on_this_tp_rank": "ec8f9840622daed1"}),
    *_rows("cpu.current_device", M + "tensor_parallel.mappings", HostTorch(cuda=("current_device",)),
           "TP/EP gather, reduce-scatter and all-to-all outputs on the current CUDA device", {
               "_gather_along_last_dim": "25a6dd6c38abe2cd",
               "_gather_along_first_dim": "9ca7b839235cfbc3",
               "_reduce_scatter_along_first_dim": "f85c2232842ad481",
               "_AllToAll.forward": "8396805b35bc0341"}),
    *_rows("cpu.current_device", M + "tensor_parallel.layers", HostTorch(cuda=("current_device",)),
           "TP layers' weights and sequence-parallel backward buffers on the current CUDA device", {
               "VocabParallelEmbedding.__init__": "ddc07130f80a8f9e",
               "LinearWithGradAccumulationAndAsyncCommunication.backward": "034d10a93552d91a",
               "ColumnParallelLinear.__init__": "fa67d433a1559526",
               "RowParallelLinear.__init__": "942fb77dd815d97f"}),
    *_rows("cpu.current_device", M + "distributed.param_and_grad_buffer",
           HostTorch(cuda=("current_device",)), "DDP gradient buffers on the current CUDA device", {
               "_ParamAndGradBuffer.__init__": "d9bfbb54b1953b40"}),
    _one("cpu.split_sizes", M + "transformer.moe.moe_utils", "maybe_move_tensor_to_cpu",
         CPU + "split_sizes_as_numpy", "converts only CUDA split sizes: gloo's all_to_all_single "
         "rejects the CPU tensors it leaves at EP >= 2", "d48cb2407326de4b"),
    _one("cpu.split_sizes", M + "transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
         CPU + "split_sizes_as_numpy", "the dispatcher's own import of the same function",
         "d48cb2407326de4b"),
    _one("cpu.default_causal_mask", M + "fusions.fused_softmax", "get_default_causal_mask",
         CPU + "causal_mask_on_host", 'the local softmax\'s default causal mask has device="cuda"',
         "0a154dc8d30d1ba6"),
    *_rows("cpu.schedule_buffers", M + "pipeline_parallel.schedules", HostTorch(factories=True),
           'the schedules\' token counter is allocated with device="cuda"', {
               "forward_step": "991fac83a5760919",
               "forward_backward_no_pipelining": "d2b16e8505301b48",
               "forward_backward_pipelining_with_interleaving": "e367ab1392a2d872",
               "forward_backward_pipelining_without_interleaving": "c0443610099bbad6"}),
    _one("cpu.checkpoint_without_output", M + "tensor_parallel.random",
         "CheckpointWithoutOutput.__init__", CPU + "checkpoint_without_fp8_state",
         "fp8=False still sets self.fp8 (fp8 is not None): asks Transformer Engine, absent on CPU",
         "a09f1ea5661fe43e"),
]  # fmt: skip

LOOP_ROWS: list[Patch] = [
    *_rows("cpu_loop.initialize", T + "initialize", HostTorch(cuda=(*_LOOP, "device_count", "set_device"),
           factories=True), "initialisation skips model parallelism and seeding without a CUDA "
           "device and places tensors on it", {
               "initialize_megatron": "8fe56d11efb14104",
               "_initialize_distributed": "25f36f186cd6415a",
               "_set_random_seed": "cfac9806e33722ab",
               "_warmup_jit_function": "6309e1dddc2c502b"}),
    _one("cpu_loop.initialize", T + "training", "initialize_megatron", LOOP + "allowing_no_cuda",
         "pretrain's initialize_megatron asserts CUDA unless allow_no_cuda", "8fe56d11efb14104"),
    *_rows("cpu_loop.training", T + "training", HostTorch(cuda=(*_LOOP, "Stream", "current_stream",
           "stream"), factories=True), 'start-time all-reduces, loss dictionaries and data-loader '
           'flags on device="cuda"; synchronize / empty_cache; get_model\'s side stream', {
               "update_seqlen_stats_from_cu_seqlens": "697a4f86585a27bc",
               "pretrain": "cf3a4792ac4963c5",
               "get_model": "5eddcbc2b0bf91da",
               "get_megatron_ddp_config": "06d441fcb741f952",
               "setup_model_and_optimizer": "32168fc86eab12a1",
               "dummy_train_step": "54aa1881a6f80bd4",
               "train_step": "24a1feeb0a08d846",
               "training_log": "2da9e48509db96c4",
               "save_checkpoint_and_time": "d526e97cbdb6bf51",
               "post_training_step_callbacks": "187c2edb40138930",
               "checkpoint_and_decide_exit": "9698928544cfed9c",
               "train": "075c9c627c6f197a",
               "evaluate": "0531c445cb0eea0f",
               "evaluate_and_print_results": "3f2914b37a4096bb",
               "build_train_valid_test_data_loaders": "73358ab15a927c18",
               "build_train_valid_test_data_iterators": "e9cb1d9938fbbce7"}),
    _one("cpu_loop.training", T + "training", "get_model", LOOP + "model_left_on_host",
         "get_model moves each stage with model.cuda(current_device)", "5eddcbc2b0bf91da"),
    *_rows("cpu_loop.timers", M + "timers", HostTorch(cuda=_LOOP, factories=True),
           "synchronize around timed regions; the all-gather buffer on the current device", {
               "Timer.start": "9320ba926eedaf20",
               "Timer.stop": "6f214274e2cd305d",
               "Timers._get_elapsed_time_all_ranks": "777e0dca123d470c"}),
    *_rows("cpu_loop.optimizer", M + "optimizer.optimizer", HostTorch(cuda=_LOOP, factories=True),
           'loss-scale and found_inf buffers with device="cuda"', {
               "MegatronOptimizer.has_grad_norm_group": "183a0ed9e6514f73",
               "MegatronOptimizer.offload_to_cpu": "35c369ba60564512",
               "MegatronOptimizer.restore_from_cpu": "fa1e409dc0e2c4c7",
               "MixedPrecisionOptimizer.__init__": "01123f834a0ac05b",
               "FP32Optimizer.__init__": "49454dd5196cd8c8",
               "ChainedOptimizer.get_loss_scale": "49cb70a26d3c6d3a"}),
    *_rows("cpu_loop.rng_checkpoint", M + "rerun_state_machine", HostTorch(cuda=(*_LOOP, *_RNG),
           factories=True), "the rerun state machine captures CUDA RNG state and reduces on the "
           "current device", {
               "RerunStateMachine._reduce_any": "14be74e3dbf7e7fd",
               "RerunStateMachine.validate_result": "53f746ba2f9f5640",
               "RerunStateMachine._save_state": "ffb8b39b8cf5df4b",
               "RerunStateMachine._restore_state": "cc9795e0974e7f19",
               "RerunStateMachine._log_validation_error_to_file": "7d03d5a6b56cb055"}),
    *_rows("cpu_loop.rng_checkpoint", T + "checkpointing", HostTorch(cuda=(*_LOOP, *_RNG),
           factories=True), "checkpoints save and restore CUDA RNG state", {
               "read_metadata": "80c8505f8c7a46b4",
               "get_rng_state": "1bbe2c2b1ae41011",
               "load_checkpoint": "8f460d583f0bbf80"}),
    _one("cpu_loop.rng_checkpoint", T + "training", "build_train_valid_test_data_iterators",
         LOOP + "iterators_leaving_the_generator",
         "with CUDA RNG on the CPU generator, data-loader seeds would move dropout's draws",
         "e9cb1d9938fbbce7"),
    *_rows("cpu_loop.checkpoint_dist", M + "dist_checkpointing.strategies.filesystem_async",
           HostTorch(cuda=_LOOP, factories=True), "torch_dist saves synchronize after copying to the host", {
               "FileSystemWriterAsync.prepare_write_data": "6ba80eae1cf40d9b",
               "FileSystemWriterAsync.preload_tensors": "27be0f958fb1057b"}),
    *_rows("cpu_loop.checkpoint_dist", M + "dist_checkpointing.strategies.state_dict_saver",
           HostTorch(cuda=_LOOP, factories=True), "the save's failure flag on the current device", {
               "verify_global_md_reuse": "35910b35ef7f8f7c",
               "save_state_dict_async_finalize": "46bcb6be1e096e97"}),
    *_rows("cpu_loop.grad_norm", M + "optimizer.clip_grads", HostTorch(cuda=_LOOP, factories=True),
           'gradient norms allocated with device="cuda"', {
               "get_grad_norm_fp32": "9a16025900adb637",
               "count_zeros_fp32": "8aaa23e506d1effd"}),
    *_rows("cpu_loop.grad_norm", M + "utils", HostTorch(cuda=_LOOP, factories=True),
           'the local multi-tensor L2 norm returns its norm on "cuda"', {
               "local_multi_tensor_l2_norm": "afdb0d1778923660",
               "check_param_hashes_across_dp_replicas": "60066b8294cefbc8",
               "drain_embedding_wgrad_compute": "31c8285dcf95f32d",
               "StragglerDetector.start_method": "bcb26a2d92b96d69",
               "StragglerDetector.stop_method": "590b72c7fe842e37",
               "StragglerDetector.elapsed": "c38b6791b852bc90"}),
    _one("cpu_loop.grad_norm", M + "optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
         LOOP + "clip_by_total_norm", "asserts grad.type() == 'torch.cuda.FloatTensor': a copy of "
         "its body reads it as fp32", "786426254ea8f52b"),
    _one("cpu_loop.grad_norm", M + "optimizer.optimizer", "clip_grad_by_total_norm_fp32",
         LOOP + "clip_by_total_norm", "the optimizer's own import of the same function",
         "786426254ea8f52b"),
    *_rows("cpu_loop.common_utils", T + "utils.common_utils", HostTorch(cuda=_LOOP, factories=True),
           'parameter norms, loss averaging and max-stat reductions on "cuda"', {
               "_compute_norm_2": "91135cb7c5bf3fb8",
               "calc_dtensor_params_l2_norm": "bacf938aec75c0e4",
               "reduce_max_stat_across_model_parallel_group": "8ab40e5c08c5f1ac",
               "logical_and_across_model_parallel_group": "9dbc211532df8b59"}),
]  # fmt: skip
