"""Megatron's local (torch) norms with sequence parallelism: TP > 1 + ``--sequence-parallel`` without TE.

``WrappedTorchNorm`` (the norm of Megatron's local layer specs) asserts ``not config.sequence_parallel``;
on GPU the SP path is Transformer Engine's norms. Example::

    spec = with_sequence_parallel_norms(spec)    # GPT block spec, hybrid stack spec, layer spec
"""

import copy
from typing import Any

from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_ext.common.spec_tree import swap_module


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm`` (torch ``LayerNorm``/``RMSNorm``) that accepts sequence parallelism."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        view = copy.copy(config)  # Megatron's checks, except the SP one this class exists for
        view.sequence_parallel = False
        norm = WrappedTorchNorm(view, hidden_size, eps, **kwargs)
        # A norm is per token, so exact on a sequence shard; but its parameters see only this
        # rank's tokens, so their gradients must be all-reduced over the TP group, which Megatron's
        # finalize_model_grads does for every parameter marked sequence_parallel.
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_norms(node: Any) -> Any:
    """``node`` with every ``WrappedTorchNorm`` replaced by :class:`SequenceParallelTorchNorm`."""
    return swap_module(node, WrappedTorchNorm, SequenceParallelTorchNorm)
