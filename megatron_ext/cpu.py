"""Makes Megatron-Core's real MoE stack run on CPU over gloo (tests, the demo, CI); a no-op with CUDA.

Megatron-Core 0.19.2 hard-codes a few CUDA calls on paths that are otherwise device-agnostic. Each patch
below replaces exactly one such call, names the Megatron function it works around, and fails loudly when the
symbol it patches has moved (so an upgrade is noticed, not silently half-patched). The patches never change
numerics: they only swap CUDA streams, CUDA RNG state and ``torch.cuda.current_device()`` for their CPU
equivalents, hand gloo plain split sizes, and keep a recompute checkpoint from asking Transformer Engine
for fp8 state when TE is not installed.

Example::

    from megatron_ext.cpu import enable_cpu_mode
    enable_cpu_mode()          # before building any Megatron module
    # MoELayer (alltoall / allgather dispatcher), GPTModel, RouterReplay now run on CPU / gloo.

``tests/test_cpu.py`` runs every patched call *unpatched* in a fresh process and asserts it still fails on
CPU, so a Megatron release that fixes one of them is noticed and its patch can go.
"""

import contextlib
import functools
import importlib
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

_ENABLED = False


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: CPU work is already ordered."""

    def wait_stream(self, stream: Any) -> None:
        del stream

    def record_event(self, event: Any = None) -> "_NullStream":
        del event
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        del event

    def query(self) -> bool:
        return True


class _CudaProxy(types.SimpleNamespace):
    """``torch.cuda`` with selected attributes overridden; everything else falls through."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    """A ``torch`` module whose ``cuda`` attribute is a :class:`_CudaProxy`, for one Megatron module.

    Extra keyword arguments override top-level ``torch`` functions the same way (e.g. ``zeros``).
    """

    def __init__(self, cuda_overrides: dict[str, Any], **torch_overrides: Any) -> None:
        super().__init__("torch")
        self.cuda = _CudaProxy(**cuda_overrides)
        for name, value in torch_overrides.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _module_with(module_name: str, *symbols: str) -> types.ModuleType:
    """Imports ``module_name`` and checks it still defines ``symbols``; raises if Megatron moved them."""
    module = importlib.import_module(module_name)
    for symbol in symbols:
        obj: Any = module
        for part in symbol.split("."):
            if not hasattr(obj, part):
                raise RuntimeError(
                    f"megatron_ext.cpu: {module_name}.{symbol} is gone; this megatron-core version "
                    "needs a new CPU patch (see megatron_ext/cpu.py)"
                )
            obj = getattr(obj, part)
    return module


def _patch_rng_tracker() -> None:
    """``tensor_parallel.random``: CUDA RNG state -> the CPU generator.

    ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker.add/fork`` read and write CUDA RNG state
    (``torch.cuda.get_rng_state``, ``_get_cuda_rng_state``, ``_set_cuda_rng_state``), which fails without a
    CUDA driver. Mapping them onto the CPU generator keeps Megatron's per-TP/EP-rank seeding and its
    forked dropout streams working, so expert weights differ per EP rank exactly as on GPU.
    """
    random = _module_with(
        "megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "_set_cuda_rng_state"
    )

    def get_state(
        device: Any = None, clone: bool = False, graph_safe: bool = False
    ) -> torch.Tensor:
        del device, clone, graph_safe
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        del device, graph_safe
        torch.set_rng_state(new_state)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state
    random.torch = _TorchProxy(
        {
            "get_rng_state": lambda device="cuda": torch.get_rng_state(),
            "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
            "manual_seed": torch.manual_seed,
        }
    )
    # fork() warns whenever the forked (here: CPU) stream was used, which on CPU is every forked init.
    logging.getLogger(random.__name__).setLevel(logging.ERROR)


def _override_cuda(module: types.ModuleType, **overrides: Any) -> None:
    """Gives ``module`` a ``torch`` whose ``torch.cuda`` has ``overrides`` (composes across patches)."""
    if not isinstance(module.torch, _TorchProxy):
        module.torch = _TorchProxy({})
    for name, value in overrides.items():
        setattr(module.torch.cuda, name, value)


#: Megatron modules that use CUDA streams/events on the CPU-capable path, and where.
_STREAM_USERS: dict[str, str] = {
    "megatron.core.transformer.moe.token_dispatcher": (
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"
    ),
    "megatron.core.distributed.param_and_grad_buffer": "_ParamAndGradBucketGroup.start_grad_sync",
    "megatron.core.pipeline_parallel.p2p_communication": "P2PCommunicator",
    "megatron.core.transformer.moe.shared_experts": "SharedExpertMLP",
}


def _patch_null_streams() -> None:
    """CUDA streams and events -> no-ops inside the modules of :data:`_STREAM_USERS`.

    ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` for its batched device-to-host
    copies and ``_maybe_dtoh_and_synchronize`` enters ``torch.cuda.stream(...)`` and records events;
    Megatron's DDP (``_ParamAndGradBucketGroup.start_grad_sync`` / ``finish_grad_sync``) orders its gradient
    all-reduce against ``torch.cuda.current_stream()``; the pipeline's ``P2PCommunicator`` calls
    ``torch.cuda.synchronize()`` after its sends and receives; ``SharedExpertMLP`` runs the shared experts on
    a side stream under ``--moe-shared-expert-overlap``. On CPU every op is already synchronous, so null
    streams and a no-op synchronize are exact.
    """
    null = _NullStream()
    for module_name, symbol in _STREAM_USERS.items():
        _override_cuda(
            _module_with(module_name, symbol),
            Stream=lambda *a, **k: null,
            Event=lambda *a, **k: null,
            current_stream=lambda *a, **k: null,
            stream=lambda *a, **k: contextlib.nullcontext(),
            synchronize=lambda *a, **k: None,
        )


def _patch_split_sizes() -> None:
    """``moe_utils.maybe_move_tensor_to_cpu``: also turn CPU split tensors into numpy.

    It converts only CUDA tensors, so on CPU the all-to-all split sizes stay tensors and gloo's
    ``all_to_all_single`` raises ``TypeError`` at EP >= 2. The patched version converts CPU tensors the same way.
    """
    moe_utils = _module_with("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu")
    dispatcher = _module_with(
        "megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"
    )
    original: Callable[..., Any] = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


#: Megatron modules that place tensors on ``torch.cuda.current_device()`` on the CPU-capable path, and where.
_CURRENT_DEVICE_USERS: dict[str, str] = {
    "megatron.core.transformer.moe.router": "Router.gating",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding.get_emb",
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor",
    "megatron.core.tensor_parallel.mappings": "_gather_along_first_dim",
    "megatron.core.tensor_parallel.layers": "LinearWithGradAccumulationAndAsyncCommunication",
    "megatron.core.distributed.param_and_grad_buffer": "_ParamAndGradBuffer",
    "megatron.core.pipeline_parallel.p2p_communication": "P2PCommunicator",
}


def _patch_current_device() -> None:
    """``torch.cuda.current_device()`` -> ``"cpu"`` inside the modules of :data:`_CURRENT_DEVICE_USERS`.

    ``Router.gating`` moves CPU-initialised router weights there, ``TopKRouter.__init__`` places its
    aux-loss / expert-bias buffers there, and ``RotaryEmbedding.get_emb`` moves ``inv_freq`` there on the
    first forward, ``GlobalMemoryBuffer.get_tensor`` (the local ``DotProductAttention``'s scratch) allocates
    its scratch buffer there, and the TP/EP gather and reduce-scatter helpers in ``tensor_parallel.mappings``
    allocate their outputs there, as does the sequence-parallel backward of the TP linear layers
    (``LinearWithGradAccumulationAndAsyncCommunication``), Megatron's DDP gradient buffers
    (``_ParamAndGradBuffer``) and the pipeline's receive buffers (``P2PCommunicator``). Only these modules see the change; ``torch.cuda`` itself is untouched.
    """
    for module_name, symbol in _CURRENT_DEVICE_USERS.items():
        _override_cuda(_module_with(module_name, symbol), current_device=lambda: "cpu")


def _patch_default_causal_mask() -> None:
    """``fused_softmax.get_default_causal_mask``: build the causal mask on CPU.

    ``transformer.utils.get_default_causal_mask`` hard-codes ``device="cuda"``; the local attention
    backend (``FusedScaleMaskSoftmax.forward_torch_softmax``) calls it whenever no mask is passed.
    """
    fused_softmax = _module_with("megatron.core.fusions.fused_softmax", "get_default_causal_mask")

    @functools.lru_cache(maxsize=8)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = causal_mask


def _patch_schedule_buffers() -> None:
    """``pipeline_parallel.schedules``: ``torch.zeros(..., device="cuda")`` -> CPU.

    The forward-backward schedules allocate their token counter (``total_num_tokens``) with a hard-coded
    ``device="cuda"``; on CPU it is allocated on the host instead, everything else unchanged.
    """
    schedules = _module_with(
        "megatron.core.pipeline_parallel.schedules",
        "forward_backward_pipelining_without_interleaving",
    )

    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)

    schedules.torch = _TorchProxy({}, zeros=zeros)


def _patch_checkpoint_without_output() -> None:
    """``tensor_parallel.random.CheckpointWithoutOutput``: no fp8 recompute state without TE.

    Its ``__init__(fp8=False)`` sets ``self.fp8 = fp8 is not None``, true for the default ``False``,
    so every default construction (the selective recompute of ``moe_act`` and ``layernorm``) asks
    Transformer Engine's ``FP8GlobalStateManager`` for the fp8 state at checkpoint time: a
    ``NameError`` where TE is not installed, as on CPU. Without TE there is no fp8 state to save, so
    the flag is cleared after Megatron's own ``__init__`` (its non-fp8 branch: a plain recompute).
    """
    random = _module_with(
        "megatron.core.tensor_parallel.random", "HAVE_TE", "CheckpointWithoutOutput.__init__"
    )
    if random.HAVE_TE:  # TE's fp8 state is there to ask: Megatron's own behaviour
        return
    cls = random.CheckpointWithoutOutput
    original = getattr(cls.__init__, "__wrapped__", cls.__init__)  # idempotent

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.fp8 = False

    cls.__init__ = __init__


#: Every patch, in the order applied. Names are used by the tests that prove each is still needed.
PATCHES: dict[str, Callable[[], None]] = {
    "rng_tracker": _patch_rng_tracker,
    "null_streams": _patch_null_streams,
    "split_sizes": _patch_split_sizes,
    "current_device": _patch_current_device,
    "default_causal_mask": _patch_default_causal_mask,
    "schedule_buffers": _patch_schedule_buffers,
    "checkpoint_without_output": _patch_checkpoint_without_output,
}


def enable_cpu_mode() -> bool:
    """Patches Megatron-Core so its MoE stack runs on CPU / gloo. Idempotent.

    Returns:
        True if the patches are in place, False if CUDA is available (then nothing is patched).
    """
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if not _ENABLED:
        for patch in PATCHES.values():
            patch()
        _ENABLED = True
    return True


@contextlib.contextmanager
def assume_device_capability(capability: tuple[int, int] = (9, 0)) -> Any:
    """Within the block, Megatron's argument validation sees a GPU of ``capability`` (no-op with CUDA).

    ``megatron.training.arguments.validate_args`` asks ``torch.cuda.get_device_capability()`` for
    ``--moe-grouped-gemm`` and ``get_device_arch_version()`` with TP or CP > 1; a dry run of a GPU launch on a CPU-only login node has no device to ask, so it
    validates against the target's capability instead (default 9.0: H100/H200). Restored on exit.
    """
    if torch.cuda.is_available():
        yield
        return
    arguments = _module_with(
        "megatron.training.arguments", "validate_args", "get_device_arch_version"
    )
    previous = arguments.torch, arguments.get_device_arch_version
    arguments.torch = _TorchProxy({"get_device_capability": lambda device=None: capability})
    arguments.get_device_arch_version = lambda: capability[0]
    try:
        yield
    finally:
        arguments.torch, arguments.get_device_arch_version = previous


def cpu_mode_enabled() -> bool:
    """True once :func:`enable_cpu_mode` has patched Megatron in this process."""
    return _ENABLED
