"""The marker that tells recomputing routers whose micro-batch is in backward.

Activation recompute reruns MoE routers during backward, possibly after later micro-batches ran
their forward (pipeline schedules). An identity on each decoder block's output calls back, when
its backward starts, with the key of the micro-batch that produced it.
"""

from collections.abc import Callable, Hashable
from typing import Any

import torch
from megatron.core.utils import make_viewless_tensor


class _BackwardKeyMarker(torch.autograd.Function):
    """Identity on the decoder output; its backward calls ``on_backward(key)``.

    Apply through :func:`mark_backward_key`: the output is a view, and a non-last pipeline
    stage's output is freed by Megatron's ``deallocate_output_tensor``, which asserts
    ``out._base is None``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, on_backward: Callable, key: Hashable):
        ctx.on_backward, ctx.key = on_backward, key
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.on_backward(ctx.key)
        return grad, None, None


def mark_backward_key(
    hidden: torch.Tensor, on_backward: Callable[[Hashable], None], key: Hashable
) -> torch.Tensor:
    """``hidden`` through the marker, returned viewless (``_base is None``)."""
    marked = _BackwardKeyMarker.apply(hidden, on_backward, key)
    # Shares marked's storage; keep_graph keeps the marker's backward on the graph.
    return make_viewless_tensor(marked, requires_grad=True, keep_graph=True)
