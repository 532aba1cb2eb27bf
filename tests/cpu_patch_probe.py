"""Runs each patched Megatron call with its CPU patch removed, on 2 gloo ranks of their own (used by tests/cpu/test_model_stack.py).

:func:`probe` runs on each rank (``run_distributed(probe, 2, ep=2, fresh=True)``: workers started
for it and stopped after it, since it leaves their patches changed) and returns {check: "ok" |
"<exception text>"}. Each check is a real training step of the
tiny MoE GPTModel at EP=2 (alltoall dispatcher), so the all-to-all split sizes and the EP gathers are
exercised too; DDP's patches are checked on the same step wrapped in Megatron's DistributedDataParallel; the TP linear layers' patch is checked by a TP=2 sequence-parallel step instead.
``all_patches`` (and ``all_patches_sequence_parallel``) is the positive control: with every patch the same step must succeed.
Removing a patch fails symmetrically on both ranks before any collective, so nothing hangs.
"""

import inspect

import torch

SP_ONLY = "megatron.core.tensor_parallel.layers"
PP_ONLY = "megatron.core.pipeline_parallel.p2p_communication"
SHARED_ONLY = "megatron.core.transformer.moe.shared_experts"
DDP_ONLY = "megatron.core.distributed.param_and_grad_buffer"


def probe() -> dict[str, str]:
    """Every check's outcome on this rank (run under ``run_distributed`` at EP=2, see above)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.utils import GlobalMemoryBuffer

    import megatron_ext.cpu.model_stack as cpu
    from megatron_ext import compat

    def apply(skip: str = "", unpatch: tuple[str, str] = ("", "")) -> None:
        """Every CPU-mode row except group ``skip``; then ``unpatch = (module, group)``: that group's
        rows in that one module put back to Megatron's own (its other modules keep theirs)."""
        compat.restore(compat.rows("cpu"))
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
        parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()  # else a CPU buffer is cached
        compat.apply(*(f"cpu.{name}" for name in cpu.PATCHES if name != skip))
        module_name, group = unpatch
        if module_name:
            rows = [r for r in compat.rows(f"cpu.{group}") if r.module == module_name]
            assert rows, unpatch
            compat.restore(rows)

    def train_step(
        sequence_parallel: bool = False,
        ddp: bool = False,
        recompute_layernorm: bool = False,
        shared_overlap: bool = False,
    ) -> str:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

        try:
            model_parallel_cuda_manual_seed(1, force_reset_rng=True)
            # Selective recompute of the norms: Megatron's CheckpointWithoutOutput.
            extra = (
                dict(recompute_granularity="selective", recompute_modules=["layernorm"])
                if recompute_layernorm
                else {}
            )
            if shared_overlap:  # shared experts overlapped with the all-to-all on a side stream
                extra.update(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
            config = tiny_moe_config(
                moe_token_dispatcher_type="alltoall",
                sequence_parallel=sequence_parallel,
                **extra,
            )
            model = build_tiny_gpt(config)
            if ddp:  # Megatron's own DDP: its gradient buffers and all-reduce join the step
                model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
            tokens = torch.randint(0, 128, (2, 16))
            loss = model(tokens, torch.arange(16).expand(2, 16), attention_mask=None, labels=tokens)
            loss.sum().backward()
            if ddp:
                model.finish_grad_sync()
            return "ok"
        except Exception as exc:  # the probe reports, the test decides
            return f"{type(exc).__name__}: {exc}"[:300]

    assert parallel_state.get_expert_model_parallel_world_size() == 2  # run_distributed's ep=2
    results = {}
    apply()
    results["all_patches"] = train_step()
    results["all_patches_ddp"] = train_step(ddp=True)
    results["all_patches_recompute"] = train_step(recompute_layernorm=True)
    results["all_patches_shared_overlap"] = train_step(shared_overlap=True)
    for name in cpu.PATCHES:
        # te_partition: only a CP > 1 step reads it (tests/common/test_thd_partition.py checks it).
        if name not in ("current_device", "null_streams", "schedule_buffers", "te_partition"):
            apply(skip=name)
            results[name] = train_step(recompute_layernorm=name == "checkpoint_without_output")
    for module_name in cpu._STREAM_USERS:
        if module_name != PP_ONLY:
            apply(unpatch=(module_name, "null_streams"))
            results[f"null_streams:{module_name}"] = train_step(
                ddp=module_name == DDP_ONLY, shared_overlap=module_name == SHARED_ONLY
            )
    for module_name in cpu._CURRENT_DEVICE_USERS:
        if module_name not in (SP_ONLY, PP_ONLY):
            apply(unpatch=(module_name, "current_device"))
            results[f"current_device:{module_name}"] = train_step(ddp=module_name == DDP_ONLY)
    # Pipeline parallelism: unpatched, a pipeline step fails on one stage only and its peer then waits in
    # a send/recv until the gloo timeout, so these three are checked on Megatron's source: the CUDA call
    # each patch covers is still there. tests/replay/test_binding_pipeline.py is the positive control
    # (Megatron's 1F1B schedule at PP=2 on CPU mode alone).
    from megatron.core.pipeline_parallel import p2p_communication

    p2p_source = inspect.getsource(p2p_communication.P2PCommunicator)
    found = {
        "schedule_buffers": 'device="cuda"' in inspect.getsource(schedules),
        f"null_streams:{PP_ONLY}": "torch.cuda.synchronize()" in p2p_source,
        f"current_device:{PP_ONLY}": "torch.cuda.current_device()" in p2p_source,
    }
    results.update(
        {
            k: "ok" if not v else "RuntimeError: CUDA call still in Megatron's source"
            for k, v in found.items()
        }
    )
    # The TP linear layers allocate on the device only in their sequence-parallel backward: TP=2 + SP.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    apply()
    results["all_patches_sequence_parallel"] = train_step(sequence_parallel=True)
    apply(unpatch=(SP_ONLY, "current_device"))
    results[f"current_device:{SP_ONLY}"] = train_step(sequence_parallel=True)
    return results
