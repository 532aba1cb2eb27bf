"""A grouped-linear expert backend for Megatron's ``TEGroupedMLP`` built on ``torch._grouped_mm``.

Megatron-Core 0.19's ``TEGroupedMLP`` takes pluggable ``linear_fc1``/``linear_fc2`` builders;
this one runs without Transformer Engine (CPU or GPU) and, when the config says the GEMM is
quantized (fp8, mxfp8, nvfp4), refuses unaligned groups the way the real low-precision grouped
kernels do. That turns "every group reached the GEMM aligned" into something a CPU test can
observe: Megatron's router padding raises here for nvfp4 when a rank has fewer tokens than 128,
megatron_ext's aligning dispatcher does not. The math itself stays in the config's dtype (the
fp8 kernel is exercised on a GPU by tools/gpu_check.sh).

Empty groups. An expert with no tokens is a 0-row group. PyTorch issue 172439: on B200 (SM100)
``torch._grouped_mm``'s backward writes non-zero (uninitialised) weight gradients for 0-row groups;
they should be exactly 0. The aligner keeps empty groups empty (0 rounds up to 0), so this layer
guards the weight gradient itself: when the host group sizes show an empty group, the gradient
of those groups' weights is replaced by 0 (``torch.where``, so NaN/inf garbage is dropped too). The
mask comes from the host list the kernel already takes: no device-to-host sync, and nothing runs
when no group is empty.

Example::

    submodules = GroupedMLPSubmodules(linear_fc1=GroupedMMLinear, linear_fc2=GroupedMMLinear)
    experts = ModuleSpec(module=TEGroupedMLP, submodules=submodules)
"""

import torch
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.transformer_config import TransformerConfig


class UnalignedGroupError(RuntimeError):
    """A quantized grouped GEMM was handed a group whose row count is not a multiple."""


def check_groups_aligned(tokens_per_expert: list[int], align: int, where: str) -> None:
    """Raises like a low-precision grouped kernel when a group is not a multiple of ``align``.

    Args:
        tokens_per_expert: Host split sizes (the kernels take them on the host too).
        align: Required multiple (0 or 1: anything goes).
        where: Module name for the message.
    """
    if align <= 1:
        return
    bad = [(e, n) for e, n in enumerate(tokens_per_expert) if n % align]
    if bad:
        raise UnalignedGroupError(
            f"{where}: quantized grouped GEMM needs every group's rows to be a multiple of "
            f"{align}; got (expert, rows) {bad} of {list(tokens_per_expert)}"
        )


def _zero_grad_of_empty_groups(w_GIO: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    """An alias of ``w_GIO`` whose gradient is exactly 0 for the groups with no rows.

    A per-call alias (``w_GIO[:]``) carries the hook, so hooks never pile up on the parameter.
    """
    empty_G = torch.tensor([n == 0 for n in tokens_per_expert], device=w_GIO.device)
    alias_GIO = w_GIO[:]
    alias_GIO.register_hook(lambda grad: torch.where(empty_G[:, None, None], 0, grad))
    return alias_GIO


class GroupedMMLinear(torch.nn.Module):
    """One weight per local expert, applied to contiguous row groups with ``torch._grouped_mm``.

    Matches Megatron's ``GroupedLinearFc1Builder``/``GroupedLinearFc2Builder`` signature. Expert
    tensor parallelism and biases are not supported (refused).
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        pg_collection=None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        del skip_bias_add, is_expert, tp_comm_buffer_name
        if bias:
            raise ValueError("GroupedMMLinear: --add-bias-linear is not supported")
        if config.expert_tensor_parallel_size not in (None, 1):
            raise ValueError("GroupedMMLinear: --expert-tensor-parallel-size > 1 is not supported")
        self.config = config
        self.name = name or "GroupedMMLinear"
        weight = torch.empty(num_gemms, output_size, input_size, dtype=config.params_dtype)
        for w in weight:
            init_method(w)
        # Stored [G, in, out] so the grouped GEMM reads it without a transpose copy.
        self.weight = torch.nn.Parameter(weight.transpose(1, 2).contiguous())
        self.weight.allreduce = False  # expert weights: no DP all-reduce over EP

    def required_align(self) -> int:
        """The group multiple the configured GEMM precision needs (Megatron's own rule)."""
        if not (self.config.fp8 or self.config.fp4):
            return 0
        return get_align_size_for_quantization(self.config)

    def forward(
        self, x: torch.Tensor, tokens_per_expert: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies expert ``g``'s weight to its group of rows.

        Args:
            x: Rows grouped by expert, [sum(tokens_per_expert), in].
            tokens_per_expert: Host group sizes.

        Returns:
            ``(y, None)``; y is [rows, out].
        """
        check_groups_aligned(tokens_per_expert, self.required_align(), self.name)
        assert x.shape[0] == sum(tokens_per_expert), "rows differ from the group sizes"
        offs = torch.tensor(tokens_per_expert, device=x.device).cumsum(0, dtype=torch.int32)
        w = self.weight.to(x.dtype)
        if w.requires_grad and 0 in tokens_per_expert:
            w = _zero_grad_of_empty_groups(w, tokens_per_expert)
        y = torch._grouped_mm(x, w, offs=offs)
        if y.requires_grad:
            # _grouped_mm's backward rejects stride-0 (expanded) gradients.
            y.register_hook(lambda g: g.contiguous())
        return y, None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The weight as this EP rank's slice of every expert's weight (distributed checkpoints).

        The local weight ``[G, in, out]`` holds experts ``ep_rank * G .. ep_rank * G + G - 1``, so it is
        placed at that offset along the expert axis of a global ``[ep_size * G, in, out]`` tensor;
        the expert-data-parallel ranks hold replicas. Without this, Megatron's default mapping gave
        every EP rank the same key and shape, and a ``torch_dist`` checkpoint kept one EP rank's
        experts (or, at TP 2, failed with an invalid access pattern).
        """
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        del metadata
        key = f"{prefix}weight"
        expert_axis = (
            len(sharded_offsets),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        return {
            key: ShardedTensor.from_rank_offsets(
                key,
                self.weight,
                *sharded_offsets,
                expert_axis,
                replica_id=(0, 0, parallel_state.get_expert_data_parallel_rank()),
                prepend_axis_num=len(sharded_offsets),
            )
        }

    def backward_dw(self) -> None:
        """Weight gradients are computed in the normal backward (no delayed wgrad)."""
