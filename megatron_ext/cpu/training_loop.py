"""Makes Megatron's real training loop (``megatron.training.pretrain``) run on CPU over gloo (``--cpu``).

The loop around the model stack (``initialize_megatron``, ``get_model``, the optimizer, clipping,
timers, the rerun state machine, checkpointing) hard-codes CUDA in a few more places; the
``cpu_loop.*`` rows (:mod:`megatron_ext.compat.cpu_rows`) swap those calls for their CPU equivalents
or wrap a function with a factory defined here, without changing numerics. Example::

    from megatron_ext.cpu.training_loop import enable_cpu_training
    enable_cpu_training()      # before megatron.training.pretrain; implies enable_cpu_mode()
"""

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext import compat
from megatron_ext.cpu.model_stack import enable_cpu_mode

#: The ``cpu_loop.*`` groups of the compatibility table, in the order applied.
# tests/cpu/test_training_loop.py removes each group and watches the loop fail.
PATCHES: tuple[str, ...] = (
    "initialize",
    "training",
    "timers",
    "optimizer",
    "rng_checkpoint",
    "checkpoint_dist",
    "grad_norm",
    "common_utils",
)


def allowing_no_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    """``pretrain``'s ``initialize_megatron`` with ``allow_no_cuda=True`` (it asserts CUDA otherwise)."""
    return functools.partial(original, allow_no_cuda=True)


def model_left_on_host(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_model`` whose ``model.cuda(current_device)`` of each stage leaves the stage on the host."""

    @functools.wraps(original)
    def get_model(model_provider_func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def provider(*p_args: Any, **p_kwargs: Any) -> Any:
            model = model_provider_func(*p_args, **p_kwargs)
            model.cuda = lambda *a, **k: model
            return model

        return original(provider, *args, **kwargs)

    return get_model


def iterators_leaving_the_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    """``build_train_valid_test_data_iterators`` with the CPU generator's state put back afterwards."""

    @functools.wraps(original)
    def build_iterators(*args: Any, **kwargs: Any) -> Any:
        # With the CUDA RNG mapped onto the CPU generator, each DataLoader iterator's draw of its
        # workers' base seed (after load_checkpoint restored the RNG) would move the generator
        # dropout draws from. On GPU that draw never reaches the CUDA generator, so a resumed run's
        # dropout masks are an uninterrupted run's; so here too.
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    return build_iterators


def warmup_leaving_the_generator(original: Callable[..., Any]) -> Callable[..., Any]:
    """``initialize._warmup_jit_function`` with the CPU generator's state put back afterwards."""

    @functools.wraps(original)
    def warmup(*args: Any, **kwargs: Any) -> Any:
        # The warm-up draws inputs sized --seq-length / CP / TP from the "CUDA" (here CPU)
        # generator, from which Megatron then draws each router's initial weights (outside any RNG
        # fork): they would differ by CP or TP size. On GPU they do not; so here too.
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    return warmup


def clip_by_total_norm(original: Callable[..., Any]) -> Callable[..., None]:
    """``clip_grads.clip_grad_by_total_norm_fp32`` with its ``torch.cuda.FloatTensor`` type
    assertion read as "fp32 grad"."""
    # Megatron's body, copied from megatron-core 0.19.2 and fingerprinted in the table.
    from megatron.core.optimizer import clip_grads

    @functools.wraps(original)
    def clip_by_total_norm(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = []
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                # The one change: Megatron asserts param.grad.type() == "torch.cuda.FloatTensor".
                assert grad.dtype == torch.float32, f"{attr} of dtype {grad.dtype}, not fp32"
                grads.append(clip_grads.to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff.clamp_max_(1.0)
            scale = clip_grads.multi_tensor_scale_tensor_impl
        elif clip_coeff < 1.0:
            scale = clip_grads.multi_tensor_scale_impl
        else:
            return
        clip_grads.multi_tensor_applier(scale, dummy_overflow_buf, [grads, grads], clip_coeff)

    return clip_by_total_norm


def enable_cpu_training(skip: tuple[str, ...] = ()) -> bool:
    """Patches Megatron's training loop (and, first, its model stack) for CPU / gloo. Idempotent.

    Args:
        skip: ``cpu_loop`` groups to leave out (tests prove each is needed by removing it).

    Returns:
        True if patched, False when CUDA is available (nothing is patched).
    """
    if not enable_cpu_mode():
        return False
    compat.apply(*(f"cpu_loop.{name}" for name in PATCHES if name not in skip))
    return True
