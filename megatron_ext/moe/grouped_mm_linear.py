"""A grouped-linear expert backend for Megatron's ``TEGroupedMLP`` built on ``torch._grouped_mm``
(``GroupedMLPSubmodules(linear_fc1=GroupedMMLinear, linear_fc2=GroupedMMLinear)``).

It runs without Transformer Engine and, when the config says the GEMM is quantized, refuses
unaligned groups as the real low-precision kernels do: a CPU test can observe that every group
reached the GEMM aligned (the math stays in the config's dtype; tools/gpu_check.sh runs fp8).
"""

import torch
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
from megatron.core.transformer.transformer_config import TransformerConfig


class UnalignedGroupError(RuntimeError):
    """A quantized grouped GEMM was handed a group whose row count is not a multiple."""


def check_groups_aligned(tokens_per_expert: list[int], align: int, where: str) -> None:
    """Raises like a low-precision grouped kernel when a group of the host split sizes is not a
    multiple of ``align`` (0 or 1: anything goes); ``where`` names the module."""
    if align <= 1:
        return
    bad = [(e, n) for e, n in enumerate(tokens_per_expert) if n % align]
    if bad:
        raise UnalignedGroupError(
            f"{where}: quantized grouped GEMM needs every group's rows to be a multiple of "
            f"{align}; got (expert, rows) {bad} of {list(tokens_per_expert)}"
        )


def _zero_grad_of_empty_groups(w_GIO: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    """An alias of ``w_GIO`` whose gradient is exactly 0 for the groups with no rows."""
    # PyTorch issue 172439: on B200 (SM100) _grouped_mm's backward writes uninitialised weight
    # gradients for 0-row groups; torch.where drops NaN/inf garbage too. The mask comes from the
    # host list the kernel takes: no sync. A per-call alias carries the hook, so hooks never pile
    # up on the parameter.
    empty_G = torch.tensor([n == 0 for n in tokens_per_expert], device=w_GIO.device)
    alias_GIO = w_GIO[:]
    alias_GIO.register_hook(lambda grad: torch.where(empty_G[:, None, None], 0, grad))
    return alias_GIO


class GroupedMMLinear(torch.nn.Module):
    """One weight per local expert, applied to contiguous row groups with ``torch._grouped_mm``
    (Megatron's ``GroupedLinearFc1Builder`` signature; expert TP and biases are refused)."""

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
        """``(y, None)``: expert g's weight applied to its group of ``x``'s rows (grouped by
        expert by the host sizes ``tokens_per_expert``), y ``[rows, out]``."""
        check_groups_aligned(tokens_per_expert, self.required_align(), self.name)
        assert x.shape[0] == sum(tokens_per_expert), "rows differ from the group sizes"
        offs = torch.tensor(tokens_per_expert, device=x.device).cumsum(0, dtype=torch.int32)
        w = self.weight.to(x.dtype)
        if w.requires_grad and 0 in tokens_per_expert:  # nothing runs when no group is empty
            w = _zero_grad_of_empty_groups(w, tokens_per_expert)
        y = torch._grouped_mm(x, w, offs=offs)
        if y.requires_grad:
            # _grouped_mm's backward rejects stride-0 (expanded) gradients.
            y.register_hook(lambda g: g.contiguous())
        return y, None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The weight as this EP rank's slice of every expert's weight (distributed checkpoints)."""
        # The local [G, in, out] holds experts ep_rank * G .. + G - 1: placed at that offset of a
        # global [ep_size * G, in, out], expert-data-parallel ranks holding replicas. Megatron's
        # default mapping gave every EP rank the same key and shape: a torch_dist checkpoint kept
        # one EP rank's experts (or, at TP 2, failed with an invalid access pattern).
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
