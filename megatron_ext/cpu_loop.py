"""Makes Megatron's real training loop (``megatron.training.pretrain``) run on CPU over gloo (``--cpu``).

:mod:`megatron_ext.cpu` makes Megatron-Core's model stack run on CPU; the training loop around it
(``initialize_megatron``, ``get_model``, the optimizer, gradient clipping, timers, the rerun state
machine, checkpointing) hard-codes CUDA in a few more places. Each patch below swaps exactly the named
CUDA calls of one Megatron module for their CPU equivalents (``device="cuda"`` -> ``"cpu"``,
``torch.cuda.synchronize`` -> no-op, CUDA RNG state -> the CPU generator), fails loudly when the symbol it
patches has moved, and never changes numerics. ``tests/training/test_cpu_loop.py`` removes each one and
watches the loop fail.

Example::

    from megatron_ext.cpu_loop import enable_cpu_training
    enable_cpu_training()      # before megatron.training.pretrain; implies enable_cpu_mode()
"""

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext.cpu import _module_with, _NullStream, _override_cuda, _TorchProxy, enable_cpu_mode

_ENABLED: set[str] = set()


def _host(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU (anything else unchanged)."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return "cpu"
    return device


def _host_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A tensor factory (``torch.tensor``, ``zeros``, ...) that allocates CUDA requests on the host."""

    @functools.wraps(factory)
    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return factory(*args, device=_host(device), **kwargs)

    return make


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "rand", "randn")


def _host_torch(module: Any, **cuda: Any) -> None:
    """Gives ``module`` a ``torch`` whose factories allocate ``device="cuda"`` on the host and whose
    ``torch.cuda`` has ``current_device() == "cpu"``, a no-op ``synchronize``/``empty_cache`` and
    ``cuda`` overrides."""
    if not isinstance(module.torch, _TorchProxy):
        module.torch = _TorchProxy({})
    for name in _FACTORIES:
        setattr(module.torch, name, _host_factory(getattr(torch, name)))
    _override_cuda(
        module,
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        **cuda,
    )


def _cpu_rng_state(device: Any = "cuda") -> torch.Tensor:
    del device
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
    del device
    torch.set_rng_state(state)


def _patch_initialize() -> None:
    """``megatron.training.initialize``: allow no CUDA, initialise model parallelism and seeds on CPU.

    ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``;
    ``_initialize_distributed`` and ``_set_random_seed`` skip model-parallel init and the TP/EP
    seeding when ``torch.cuda.device_count() == 0``; ``MoEAuxLossAutoScaler``'s scale is placed on
    ``torch.cuda.current_device()``. Here the module sees one device whose ``set_device`` is a no-op and
    whose current device is the CPU, and ``pretrain`` calls ``initialize_megatron(allow_no_cuda=True)``.
    """
    initialize = _module_with(
        "megatron.training.initialize",
        "initialize_megatron",
        "_initialize_distributed",
        "_set_random_seed",
    )
    training = _module_with("megatron.training.training", "initialize_megatron")
    _host_torch(initialize, device_count=lambda: 1, set_device=lambda *a, **k: None)
    original = training.initialize_megatron
    if not getattr(original, "_megatron_ext_cpu", False):
        wrapped = functools.partial(original, allow_no_cuda=True)
        wrapped._megatron_ext_cpu = True  # type: ignore[attr-defined]
        training.initialize_megatron = wrapped


def _patch_training() -> None:
    """``megatron.training.training``: ``torch.tensor(..., device="cuda")`` (start-time all-reduces,
    loss dictionaries, ``build_train_valid_test_data_loaders``' flags), ``torch.cuda.synchronize`` /
    ``empty_cache`` and ``model_module.cuda(torch.cuda.current_device())`` in ``get_model``."""
    training = _module_with("megatron.training.training", "pretrain", "get_model", "train_step")
    null = _NullStream()
    # get_model wraps DDP construction in a side stream (``torch.cuda.Stream`` / ``stream``).
    _host_torch(
        training,
        Stream=lambda *a, **k: null,
        current_stream=lambda *a, **k: null,
        stream=lambda *a, **k: contextlib.nullcontext(),
    )
    original = training.get_model
    if getattr(original, "_megatron_ext_cpu", False):
        return

    @functools.wraps(original)
    def get_model(model_provider_func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def provider(*p_args: Any, **p_kwargs: Any) -> Any:
            model = model_provider_func(*p_args, **p_kwargs)
            # get_model moves each stage with ``model.cuda(current_device)``; on CPU it stays put.
            model.cuda = lambda *a, **k: model
            return model

        return original(provider, *args, **kwargs)

    get_model._megatron_ext_cpu = True  # type: ignore[attr-defined]
    training.get_model = get_model


def _patch_timers() -> None:
    """``megatron.core.timers``: ``torch.cuda.synchronize`` around timed regions (barrier=False too)
    and the all-gather buffer of ``Timers._get_elapsed_time_all_ranks`` on the current device."""
    _host_torch(_module_with("megatron.core.timers", "Timer.start", "Timers"))


def _patch_optimizer() -> None:
    """``megatron.core.optimizer.optimizer``: ``FP32Optimizer._scale`` and the mixed-precision
    optimizer's ``found_inf`` / ``_scale_one`` buffers use ``device="cuda"``."""
    _host_torch(_module_with("megatron.core.optimizer.optimizer", "FP32Optimizer"))


def _patch_rng_checkpoint() -> None:
    """``torch.cuda.get_rng_state`` / ``set_rng_state`` in the rerun state machine's state capture and
    in ``checkpointing.get_rng_state`` / the RNG restore of ``load_checkpoint``: the CPU generator.

    With the CUDA RNG mapped onto the CPU generator, ``build_train_valid_test_data_iterators`` (run by
    ``pretrain`` after ``load_checkpoint`` restored the RNG) would move the generator dropout draws from:
    each ``DataLoader`` iterator draws its workers' base seed from it. On GPU that draw never reaches the
    CUDA generator, so a resumed run's dropout masks are those of an uninterrupted run; here the
    iterators are built with the generator's state put back afterwards, so the same holds on CPU.
    """
    for name, symbol in (
        ("megatron.core.rerun_state_machine", "RerunStateMachine"),
        ("megatron.training.checkpointing", "get_rng_state"),
    ):
        _host_torch(
            _module_with(name, symbol),
            get_rng_state=_cpu_rng_state,
            set_rng_state=_set_cpu_rng_state,
        )
    training = _module_with("megatron.training.training", "build_train_valid_test_data_iterators")
    original = training.build_train_valid_test_data_iterators
    if getattr(original, "_megatron_ext_cpu", False):
        return

    @functools.wraps(original)
    def build_iterators(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return original(*args, **kwargs)

    build_iterators._megatron_ext_cpu = True  # type: ignore[attr-defined]
    training.build_train_valid_test_data_iterators = build_iterators


def _patch_checkpoint_dist() -> None:
    """``torch_dist`` checkpoints: ``FileSystemWriterAsync.preload_tensors`` (every ``torch_dist`` save,
    sync or async) ends with ``torch.cuda.synchronize()`` after copying the state to the host, and
    ``state_dict_saver.save_state_dict_async_finalize`` broadcasts its failure flag from a tensor on
    ``torch.cuda.current_device()``."""
    for name, symbol in (
        ("megatron.core.dist_checkpointing.strategies.filesystem_async", "FileSystemWriterAsync"),
        (
            "megatron.core.dist_checkpointing.strategies.state_dict_saver",
            "save_state_dict_async_finalize",
        ),
    ):
        _host_torch(_module_with(name, symbol))


def _patch_grad_norm() -> None:
    """``megatron.core.optimizer.clip_grads`` (``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``
    assert ``param.grad.type() == 'torch.cuda.FloatTensor'`` and allocate on ``"cuda"``) and
    ``megatron.core.utils.local_multi_tensor_l2_norm`` (returns its norm on ``"cuda"``)."""
    clip_grads = _module_with(
        "megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"
    )
    _host_torch(clip_grads)
    _host_torch(_module_with("megatron.core.utils", "local_multi_tensor_l2_norm"))
    optimizer = _module_with("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32")
    original = clip_grads.clip_grad_by_total_norm_fp32
    if getattr(original, "_megatron_ext_cpu", False):
        return

    @functools.wraps(original)
    def clip_by_total_norm(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        # Megatron's body, with its ``torch.cuda.FloatTensor`` type assertion read as "fp32 grad".
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = []
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
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

    clip_by_total_norm._megatron_ext_cpu = True  # type: ignore[attr-defined]
    clip_grads.clip_grad_by_total_norm_fp32 = clip_by_total_norm
    optimizer.clip_grad_by_total_norm_fp32 = clip_by_total_norm


def _patch_common_utils() -> None:
    """``megatron.training.utils.common_utils``: ``calc_params_l2_norm``, the loss averaging and
    ``reduce_max_stat_across_model_parallel_group`` allocate on ``"cuda"`` /
    ``torch.cuda.current_device()``."""
    _host_torch(_module_with("megatron.training.utils.common_utils", "calc_params_l2_norm"))


#: Every training-loop patch, in the order applied; the tests remove each one in turn.
PATCHES: dict[str, Callable[[], None]] = {
    "initialize": _patch_initialize,
    "training": _patch_training,
    "timers": _patch_timers,
    "optimizer": _patch_optimizer,
    "rng_checkpoint": _patch_rng_checkpoint,
    "checkpoint_dist": _patch_checkpoint_dist,
    "grad_norm": _patch_grad_norm,
    "common_utils": _patch_common_utils,
}


def enable_cpu_training(skip: tuple[str, ...] = ()) -> bool:
    """Patches Megatron's training loop (and, first, its model stack) for CPU / gloo. Idempotent.

    Args:
        skip: Patch names to leave out (tests prove each patch is needed by removing it).

    Returns:
        True if patched, False when CUDA is available (nothing is patched).
    """
    if not enable_cpu_mode():
        return False
    for name, patch in PATCHES.items():
        if name not in skip and name not in _ENABLED:
            patch()
            _ENABLED.add(name)
    return True
