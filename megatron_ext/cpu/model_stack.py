"""Makes Megatron-Core's real MoE stack run on CPU over gloo (tests, the demo, CI); a no-op with CUDA.

Megatron-Core 0.19.2 hard-codes a few CUDA calls on otherwise device-agnostic paths. The ``cpu.*``
rows of the compatibility table (:mod:`megatron_ext.compat.cpu_rows`) replace the named ``torch.cuda``
calls of one Megatron function each, or the function with a factory defined here, without changing
numerics. Example::

    from megatron_ext.cpu.model_stack import enable_cpu_mode
    enable_cpu_mode()          # before building any Megatron module
    # MoELayer (alltoall / allgather dispatcher), GPTModel, RouterReplay now run on CPU / gloo.
"""

import contextlib
import functools
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_ext import compat
from megatron_ext.compat.host_torch import HostTorch

#: The ``cpu.*`` groups of the compatibility table, in the order applied (the tests remove each).
# tests/cpu/test_model_stack.py runs every patched call unpatched in a fresh process and asserts it
# still fails on CPU, so a Megatron release that fixes one is noticed and its row can go.
PATCHES: tuple[str, ...] = (
    "rng_tracker",
    "null_streams",
    "split_sizes",
    "current_device",
    "default_causal_mask",
    "schedule_buffers",
    "checkpoint_without_output",
    "te_partition",
)


def _modules(group: str, cuda_name: str) -> tuple[str, ...]:
    """The Megatron modules with a row of ``group`` that runs ``torch.cuda.<cuda_name>`` on the host."""
    # Sorted: ranks that walk them in turn (tests/cpu_patch_probe.py) must walk them in one order,
    # and a set of strings iterates differently per process (string hashes are salted).
    return tuple(
        sorted(
            {
                row.module
                for row in compat.rows(group)
                if isinstance(row.replacement, HostTorch) and cuda_name in row.replacement.cuda
            }
        )
    )


#: Megatron modules where CPU mode runs CUDA streams/events as no-ops (in the functions named by the table).
_STREAM_USERS = _modules("cpu.null_streams", "Stream")
#: Megatron modules where CPU mode makes ``torch.cuda.current_device()`` ``"cpu"`` (ditto).
_CURRENT_DEVICE_USERS = _modules("cpu.current_device", "current_device")


def cpu_rng_state(original: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``random._get_cuda_rng_state`` -> the CPU generator's state."""
    # Megatron's forked dropout streams and per-rank seeding then work as on GPU: expert weights
    # differ per EP rank exactly as there.
    del original

    def get_state(
        device: Any = None, clone: bool = False, graph_safe: bool = False
    ) -> torch.Tensor:
        del device, clone, graph_safe
        return torch.get_rng_state()

    return get_state


def set_cpu_rng_state(original: Callable[..., Any]) -> Callable[..., None]:
    """``random._set_cuda_rng_state`` -> sets the CPU generator's state."""
    del original

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        del device, graph_safe
        torch.set_rng_state(new_state)

    return set_state


def split_sizes_as_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``moe_utils.maybe_move_tensor_to_cpu`` that also turns CPU split tensors into numpy."""

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # Megatron's converts only CUDA tensors: on CPU the all-to-all split sizes would stay
        # tensors, and gloo's all_to_all_single raises TypeError at EP >= 2.
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move_to_cpu


def causal_mask_on_host(original: Callable[..., Any]) -> Callable[[int], torch.Tensor]:
    """``fused_softmax.get_default_causal_mask`` built on CPU."""
    # Megatron's hard-codes device="cuda", and the local softmax calls it whenever no mask is passed.
    del original

    @functools.lru_cache(maxsize=8)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    return causal_mask


def checkpoint_without_fp8_state(original: Callable[..., None]) -> Callable[..., None]:
    """``CheckpointWithoutOutput.__init__`` without fp8 recompute state when TE is absent."""
    # Its ``__init__(fp8=False)`` sets ``self.fp8 = fp8 is not None``, true for the default False,
    # so every default construction (the selective recompute of moe_act and layernorm) asks TE's
    # FP8GlobalStateManager for the fp8 state: a NameError without TE, as on CPU. With TE
    # installed, Megatron's own __init__ stays.
    if importlib.import_module("megatron.core.tensor_parallel.random").HAVE_TE:
        return original

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.fp8 = False  # cleared after Megatron's own __init__: a plain recompute

    return __init__


def te_partition_stand_in(original: Any) -> Any:
    """``megatron.core.utils.tex`` under ``--cpu``: Transformer Engine's torch extension, stood in
    by the pure-torch :func:`~megatron_ext.common.thd_partition.thd_partitioned_indices`.
    A rehearsal stand-in, never bound on a GPU launch.
    """
    # Megatron 0.19.2 calls only tex.thd_get_partitioned_indices (get_batch_on_this_cp_rank of a
    # packed micro-batch under CP). Without TE ``tex`` is None; with TE its kernel takes CUDA
    # tensors only: either way the rehearsal's host tensors need this. Checked against the kernel's
    # definition in tests/common/test_thd_partition.py.
    del original
    from megatron_ext.common.thd_partition import thd_partitioned_indices

    return types.SimpleNamespace(thd_get_partitioned_indices=thd_partitioned_indices)


def target_arch_version(original: Callable[[], int]) -> Callable[[], int]:
    """``arguments.get_device_arch_version`` answering the target's (9: H100/H200)."""
    del original
    return lambda: 9


def enable_cpu_mode() -> bool:
    """Patches Megatron-Core so its MoE stack runs on CPU / gloo (the ``cpu.*`` rows). Idempotent.

    Returns:
        True if the patches are in place, False if CUDA is available (then nothing is patched).
    """
    if torch.cuda.is_available():
        return False
    compat.apply("cpu")
    # fork() warns whenever the forked (here: CPU) stream was used, which on CPU is every forked init.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    return True


@contextlib.contextmanager
def assume_device_capability() -> Iterator[None]:
    """Within the block, Megatron's argument validation sees an H100/H200 (capability 9.0; no-op with CUDA)."""
    # validate_args asks torch.cuda.get_device_capability() for --moe-grouped-gemm and
    # get_device_arch_version() with TP or CP > 1; a dry run of a GPU launch on a CPU-only login
    # node has no device to ask, so it validates against the target's (the validate_on_target rows).
    if torch.cuda.is_available():
        yield
        return
    with compat.patched("validate_on_target"):
        yield


def cpu_mode_enabled() -> bool:
    """True once :func:`enable_cpu_mode` has patched Megatron in this process."""
    return all(compat.applied(row) for row in compat.rows("cpu"))
