"""Megatron's local (torch) norms with sequence parallelism: TP > 1 + ``--sequence-parallel`` without TE.

``WrappedTorchNorm`` (the norm of Megatron's local layer specs) asserts ``not config.sequence_parallel``:
on GPU the SP path is Transformer Engine's norms. A LayerNorm / RMSNorm is per token, so it is exact on a
sequence shard; what SP adds is that the norm's parameters see only this rank's tokens, so their
gradients must be all-reduced over the TP group. Megatron's ``finalize_model_grads`` does that for every
parameter marked ``sequence_parallel``; :class:`SequenceParallelTorchNorm` builds Megatron's own norm and
marks its parameters so. :func:`with_sequence_parallel_norms` swaps it into any spec.

Example::

    spec = with_sequence_parallel_norms(spec)    # GPT block spec, hybrid stack spec, layer spec
"""

import copy
import dataclasses
import functools
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm`` (torch ``LayerNorm``/``RMSNorm``) that accepts sequence parallelism."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        view = copy.copy(config)  # Megatron's checks, except the SP one this class exists for
        view.sequence_parallel = False
        norm = WrappedTorchNorm(view, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_norms(node: Any) -> Any:
    """``node`` with every ``WrappedTorchNorm`` replaced by :class:`SequenceParallelTorchNorm`."""
    if node is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(node, ModuleSpec):
        module = with_sequence_parallel_norms(node.module)
        submodules = with_sequence_parallel_norms(node.submodules)
        if module is node.module and submodules is node.submodules:
            return node
        return dataclasses.replace(node, module=module, submodules=submodules)
    if isinstance(node, functools.partial):
        args = [with_sequence_parallel_norms(a) for a in node.args]
        keywords = {k: with_sequence_parallel_norms(v) for k, v in node.keywords.items()}
        return functools.partial(node.func, *args, **keywords)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            if f.init:
                value = getattr(node, f.name)
                new = with_sequence_parallel_norms(value)
                if new is not value:
                    changes[f.name] = new
        return dataclasses.replace(node, **changes) if changes else node
    if isinstance(node, (list, tuple)):
        return type(node)(with_sequence_parallel_norms(n) for n in node)
    return node
