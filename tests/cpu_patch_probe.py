"""Runs each patched Megatron call with its CPU patch removed, on 2 fresh gloo ranks (used by test_cpu.py).

Rank 0 prints one JSON line: {check: "ok" | "<exception text>"}. Each check is a real training step of the
tiny MoE GPTModel at EP=2 (alltoall dispatcher) wrapped in Megatron's DistributedDataParallel, so the
all-to-all split sizes, the EP gathers and DDP's gradient buffers and all-reduce are exercised too; the TP linear layers' patch is checked by a TP=2 sequence-parallel step instead.
``all_patches`` (and ``all_patches_sequence_parallel``) is the positive control: with every patch the same step must succeed.
Removing a patch fails symmetrically on both ranks before any collective, so nothing hangs.
"""

import datetime
import importlib
import json
import os
import sys

import torch
import torch.multiprocessing as mp

SP_ONLY = "megatron.core.tensor_parallel.layers"


def _probe(rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHDYNAMO_DISABLE="1")
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    from megatron.core import parallel_state
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.utils import GlobalMemoryBuffer

    import megatron_ext.cpu as cpu

    # Every (module, attribute) a patch replaces, so a check can put the original back.
    touched = [
        (mrandom, "_get_cuda_rng_state"),
        (mrandom, "_set_cuda_rng_state"),
        (mrandom, "torch"),
        (token_dispatcher, "torch"),
        (token_dispatcher, "maybe_move_tensor_to_cpu"),
        (moe_utils, "maybe_move_tensor_to_cpu"),
        (fused_softmax, "get_default_causal_mask"),
    ] + [
        (importlib.import_module(name), "torch")
        for name in {**cpu._CURRENT_DEVICE_USERS, **cpu._STREAM_USERS}
    ]
    original = {(m.__name__, a): getattr(m, a) for m, a in touched}
    stream_names = ("Stream", "Event", "current_stream", "stream")

    def apply(skip: str = "", unpatch: tuple[str, tuple[str, ...]] = ("", ())) -> None:
        """All patches except ``skip``; then ``unpatch = (module, cuda names)`` restored in one module."""
        for module, attr in touched:
            setattr(module, attr, original[(module.__name__, attr)])
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
        parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()  # else a CPU buffer is cached
        for name, patch in cpu.PATCHES.items():
            if name != skip:
                patch()
        module_name, cuda_names = unpatch
        for cuda_name in cuda_names:  # falls through to the real torch.cuda again
            delattr(sys.modules[module_name].torch.cuda, cuda_name)

    def train_step(sequence_parallel: bool = False) -> str:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

        try:
            model_parallel_cuda_manual_seed(1, force_reset_rng=True)
            config = tiny_moe_config(
                moe_token_dispatcher_type="alltoall", sequence_parallel=sequence_parallel
            )
            # Megatron's own DDP: its gradient buffers and all-reduce are part of the step.
            model = DistributedDataParallel(
                config, DistributedDataParallelConfig(), build_tiny_gpt(config)
            )
            tokens = torch.randint(0, 128, (2, 16))
            loss = model(tokens, torch.arange(16).expand(2, 16), attention_mask=None, labels=tokens)
            loss.sum().backward()
            model.finish_grad_sync()
            return "ok"
        except Exception as exc:  # the probe reports, the test decides
            return f"{type(exc).__name__}: {exc}"[:300]

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    results = {}
    apply()
    results["all_patches"] = train_step()
    for name in cpu.PATCHES:
        if name not in ("current_device", "null_streams"):
            apply(skip=name)
            results[name] = train_step()
    for module_name in cpu._STREAM_USERS:
        apply(unpatch=(module_name, stream_names))
        results[f"null_streams:{module_name}"] = train_step()
    for module_name in cpu._CURRENT_DEVICE_USERS:
        if module_name != SP_ONLY:
            apply(unpatch=(module_name, ("current_device",)))
            results[f"current_device:{module_name}"] = train_step()
    # The TP linear layers allocate on the device only in their sequence-parallel backward: TP=2 + SP.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    apply()
    results["all_patches_sequence_parallel"] = train_step(sequence_parallel=True)
    apply(unpatch=(SP_ONLY, ("current_device",)))
    results[f"current_device:{SP_ONLY}"] = train_step(sequence_parallel=True)
    if rank == 0:
        print("PROBE " + json.dumps(results), flush=True)


if __name__ == "__main__":
    mp.spawn(_probe, args=(sys.argv[1],), nprocs=2)
