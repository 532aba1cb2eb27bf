"""Which micro-batch the model is running, and whether this pass is its forward or its recompute.

Route replay, pad skipping and the load metrics need, inside a MoE layer, the micro-batch whose
tokens it routes, also when activation recompute reruns layers in backward after later
micro-batches' forwards (no schedule order assumed, no torch private read)::

    micro_batches.attach(model_chunk)      # once per chunk: the decoder blocks' hooks
    micro_batches.begin((iteration, 0))    # before each forward
    micro_batches.key, micro_batches.recomputing   # (iteration, 0) in its recompute too; True then
"""

from collections.abc import Hashable
from typing import Any

import torch


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder stacks of ``model`` whose output carries the backward marker (a GPTModel's
    ``TransformerBlock``, a HybridModel's ``HybridStack``)."""
    # Megatron imported here only: modules holding a context stay importable without it.
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [m for m in model.modules() if isinstance(m, (TransformerBlock, HybridStack))]


class _BackwardMarker(torch.autograd.Function):
    """Identity on a decoder block's output; its backward calls ``on_backward(key)``."""

    # Apply through mark_backward: the output is a view, and Megatron's deallocate_output_tensor
    # (freeing a non-last pipeline stage's output) asserts out._base is None.

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, on_backward: Any, key: Hashable):
        ctx.on_backward, ctx.key = on_backward, key
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.on_backward(ctx.key)
        return grad, None, None


def mark_backward(hidden: torch.Tensor, on_backward: Any, key: Hashable) -> torch.Tensor:
    """``hidden`` through the marker, returned viewless (``_base is None``)."""
    from megatron.core.utils import make_viewless_tensor

    marked = _BackwardMarker.apply(hidden, on_backward, key)
    # Shares marked's storage; keep_graph keeps the marker's backward on the graph.
    return make_viewless_tensor(marked, requires_grad=True, keep_graph=True)


class MicroBatchContext:
    """The micro-batch the model runs now, set by the forward step, recovered in recompute."""

    def __init__(self) -> None:
        #: The key of the last :meth:`begin` (None before any).
        self.forward_key: Hashable | None = None
        #: Whether that micro-batch is a training one (False: an evaluation forward).
        self.training = True
        #: Counts :meth:`begin` calls: a layer seeing one serial twice in a forward runs a forward
        #: nobody began.
        self.serial = 0
        self._backward_key: Hashable | None = None
        self._recomputing = False
        self._attached: dict[int, list[Any]] = {}

    def begin(self, key: Hashable, *, training: bool = True) -> None:
        """The next forward runs micro-batch ``key`` (``training=False``: an evaluation)."""
        self.forward_key, self.training = key, training
        self._recomputing = False
        self.serial += 1

    @property
    def recomputing(self) -> bool:
        """A layer now runs again in a micro-batch's backward (activation recompute)."""
        return self._recomputing

    @property
    def key(self) -> Hashable | None:
        """The micro-batch this pass belongs to: in a recompute the one in backward."""
        return self._backward_key if self._recomputing else self.forward_key

    def enter_backward(self, key: Hashable) -> None:
        """Called by the decoder-output marker: layers now recompute micro-batch ``key``."""
        self._backward_key, self._recomputing = key, True

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks every decoder block of ``model`` (a model chunk, possibly wrapped); once per
        module, so attaching a chunk again changes nothing."""
        for block in decoder_blocks(model):
            if id(block) in self._attached:
                continue
            self._attached[id(block)] = [
                block.register_forward_pre_hook(self._block_starts),
                block.register_forward_hook(self._mark_block_output),
            ]

    def detach(self) -> None:
        """Removes every hook :meth:`attach` registered."""
        for hooks in self._attached.values():
            for hook in hooks:
                hook.remove()
        self._attached.clear()

    def _block_starts(self, module: torch.nn.Module, args: Any) -> None:
        del module, args
        self._recomputing = False  # a block's forward is a forward, never a recompute

    def _mark_block_output(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        # When that micro-batch's backward reaches the block, the marker says whose backward it is;
        # routers recomputed in it read that key. (A block's own forward is never a recompute:
        # Megatron checkpoints layers inside the block, so its pre-hook ends the recompute.)
        del module, args
        key = self.forward_key
        if key is None or not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return mark_backward(output, self.enter_backward, key)
        first = output[0] if isinstance(output, tuple) and output else None
        if isinstance(first, torch.Tensor) and first.requires_grad:
            return (mark_backward(first, self.enter_backward, key), *output[1:])
        return output
