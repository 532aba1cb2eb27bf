"""Tier: Megatron on one process (its TransformerConfig; no process group), plus one GPU test.

``GroupedMMLinear`` equals a per-expert loop, empty groups included, and keeps the weight gradient
of an empty group exactly 0 even when the grouped GEMM's backward does not (PyTorch issue 172439:
on B200, ``torch._grouped_mm`` writes non-zero gradients for 0-row groups). CPU cannot run that
kernel, so the bug is emulated: the real op, with NaN written into the empty groups' weight
gradient, which is what a kernel reading uninitialised memory may return.
"""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.moe.grouped_mm_linear import GroupedMMLinear
from megatron_ext.testing import assert_no_host_sync

REAL_GROUPED_MM = torch._grouped_mm
GROUPS = [5, 0, 7, 0, 3]  # two experts without tokens, one of them between busy ones


def make_linear(groups: int = len(GROUPS), dtype=torch.float32) -> GroupedMMLinear:
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=dtype)
    torch.manual_seed(0)
    return GroupedMMLinear(
        groups,
        8,
        12,  # row strides must be multiples of 16 bytes (the kernel requires it)
        config=cfg,
        init_method=torch.nn.init.normal_,
        bias=False,
        skip_bias_add=False,
        is_expert=True,
        tp_comm_buffer_name=None,
    )


def fwd_bwd(linear: GroupedMMLinear, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 8, generator=g).requires_grad_()
    linear.zero_grad(set_to_none=True)
    y, _ = linear(x, sizes)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    return y.detach(), linear.weight.grad.clone()


def loop_reference(linear: GroupedMMLinear, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 8, generator=g)
    w = linear.weight.detach().clone().requires_grad_()
    y = torch.cat([xs @ w[e] for e, xs in enumerate(torch.split(x, sizes))])
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    return y.detach(), w.grad


class _B200GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with the SM100 backward bug: garbage in empty groups' weight grads."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return REAL_GROUPED_MM(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()  # the real backward rejects stride-0 gradients
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            grad_x, grad_w = torch.autograd.grad(REAL_GROUPED_MM(x_, w_, offs=offs), (x_, w_), grad)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        grad_w = grad_w.clone()
        grad_w[sizes == 0] = float("nan")
        return grad_x, grad_w, None


def b200_grouped_mm(x, w, *, offs):
    return _B200GroupedMM.apply(x, w, offs)


def test_equals_a_per_expert_loop_with_empty_groups() -> None:
    linear = make_linear()
    y, grad_w = fwd_bwd(linear, GROUPS)
    ref_y, ref_grad_w = loop_reference(linear, GROUPS)
    # Bitwise on CPU (measured): each row's dot products and each group's sums are the loop's.
    assert torch.equal(y, ref_y) and torch.equal(grad_w, ref_grad_w)
    assert (grad_w[[1, 3]] == 0).all() and (grad_w[[0, 2, 4]] != 0).any()


def test_empty_groups_get_zero_weight_grad_under_the_b200_bug(monkeypatch) -> None:
    linear = make_linear()
    ref_y, ref_grad_w = fwd_bwd(linear, GROUPS)
    monkeypatch.setattr(torch, "_grouped_mm", b200_grouped_mm)
    # The emulation bites: the bare op returns NaN for the empty groups.
    w = linear.weight.detach().requires_grad_()
    offs = torch.tensor(GROUPS).cumsum(0, dtype=torch.int32)
    b200_grouped_mm(torch.randn(sum(GROUPS), 8), w, offs=offs).sum().backward()
    assert w.grad[[1, 3]].isnan().all()
    # Through GroupedMMLinear: exactly 0 there, the busy groups untouched (bitwise).
    y, grad_w = fwd_bwd(linear, GROUPS)
    assert torch.equal(y, ref_y) and torch.equal(grad_w, ref_grad_w)
    assert (grad_w[[1, 3]] == 0).all()


def test_no_empty_group_no_guard_and_no_hook_left_on_the_weight(monkeypatch) -> None:
    linear = make_linear(3)
    monkeypatch.setattr(torch, "_grouped_mm", b200_grouped_mm)
    _, grad_w = fwd_bwd(linear, [4, 2, 6])
    assert torch.isfinite(grad_w).all()
    _, grad_w = fwd_bwd(linear, [4, 0, 6])  # the guard is per call: twice, no hook piles up
    _, grad_w = fwd_bwd(linear, [0, 5, 6])
    assert (grad_w[0] == 0).all() and torch.isfinite(grad_w).all()
    assert not linear.weight._backward_hooks


def test_the_guard_makes_no_host_sync() -> None:
    linear = make_linear()
    x = torch.randn(sum(GROUPS), 8, requires_grad=True)

    def step() -> None:
        y, _ = linear(x, GROUPS)
        y.sum().backward()

    assert_no_host_sync(step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_grouped_mm_on_gpu_keeps_empty_groups_zero() -> None:
    """On the GPU's own kernel (bf16, the issue's sizes): 0-row groups get exactly 0."""
    sizes = [16 * n for n in (10, 0, 160, 28, 0, 5)]
    cfg = TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=1, params_dtype=torch.bfloat16
    )
    linear = GroupedMMLinear(
        len(sizes),
        256,
        128,
        config=cfg,
        init_method=torch.nn.init.normal_,
        bias=False,
        skip_bias_add=False,
        is_expert=True,
        tp_comm_buffer_name=None,
    ).cuda()
    x = torch.randn(sum(sizes), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, _ = linear(x, sizes)
    y.float().square().sum().backward()
    assert (linear.weight.grad[[1, 4]] == 0).all()
    assert torch.isfinite(linear.weight.grad).all()
