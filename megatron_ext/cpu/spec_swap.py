"""One module class swapped for another throughout a Megatron spec (the CPU rehearsal's stand-ins).

A spec without ``old`` comes back as the same object. Example::

    spec = swap_module(get_gpt_layer_local_spec(num_experts=8), DotProductAttention, MyAttention)
"""

import dataclasses
import functools
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec


def swap_module(node: Any, old: type, new: type) -> Any:
    """``node`` with every reference to the class ``old`` replaced by ``new``."""
    # A spec is a tree of ModuleSpecs, functools.partials (a hybrid stack's layer factories), spec
    # dataclasses (TransformerBlockSubmodules, ...) and lists. Only the paths holding ``old`` are
    # rebuilt; every other node is returned as the same object.
    if node is old:
        return new
    if isinstance(node, ModuleSpec):
        module = swap_module(node.module, old, new)
        submodules = swap_module(node.submodules, old, new)
        if module is node.module and submodules is node.submodules:
            return node
        return dataclasses.replace(node, module=module, submodules=submodules)
    if isinstance(node, functools.partial):
        args = [swap_module(a, old, new) for a in node.args]
        keywords = {k: swap_module(v, old, new) for k, v in node.keywords.items()}
        unchanged = all(a is b for a, b in zip(args, node.args, strict=True)) and all(
            keywords[k] is v for k, v in node.keywords.items()
        )
        return node if unchanged else functools.partial(node.func, *args, **keywords)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for f in dataclasses.fields(node):
            if f.init:
                value = getattr(node, f.name)
                swapped = swap_module(value, old, new)
                if swapped is not value:
                    changes[f.name] = swapped
        return dataclasses.replace(node, **changes) if changes else node
    if isinstance(node, (list, tuple)):
        return type(node)(swap_module(n, old, new) for n in node)
    return node
