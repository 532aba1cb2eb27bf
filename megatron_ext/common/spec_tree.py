"""One walker for Megatron's layer specs: trees of ``ModuleSpec`` and spec dataclasses
(``TransformerLayerSubmodules``, ``MoESubmodules``, ...), ``functools.partial`` layer factories (a
hybrid stack's), lists, tuples and dicts. The MoE layer specs and the CPU stand-ins rewrite specs
through it.

:func:`map_spec` rebuilds only the paths where ``fn`` replaced a part; everything else comes back
as the same object, so a spec with nothing to replace comes back as itself::

    map_spec(spec, lambda part: MyAttention if part is DotProductAttention else part)
    swap_module(spec, DotProductAttention, MyAttention)  # the same
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any


def map_spec(node: Any, fn: Callable[[Any], Any]) -> Any:
    """``node`` with every part ``p`` for which ``fn(p) is not p`` replaced by ``fn(p)``, top down
    (a replaced part is not walked into)."""
    replaced = fn(node)
    if replaced is not node:
        return replaced
    if isinstance(node, functools.partial):
        args = [map_spec(a, fn) for a in node.args]
        keywords = {k: map_spec(v, fn) for k, v in node.keywords.items()}
        if _same(args, node.args) and _same(keywords.values(), node.keywords.values()):
            return node
        return functools.partial(node.func, *args, **keywords)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {}
        for field in dataclasses.fields(node):
            if field.init:  # what dataclasses.replace can set
                value = getattr(node, field.name)
                new = map_spec(value, fn)
                if new is not value:
                    changes[field.name] = new
        return dataclasses.replace(node, **changes) if changes else node
    if isinstance(node, (list, tuple)):  # a block's layer_specs may be either
        items = [map_spec(n, fn) for n in node]
        return node if _same(items, node) else type(node)(items)
    if isinstance(node, dict):
        values = {k: map_spec(v, fn) for k, v in node.items()}
        return node if _same(values.values(), node.values()) else values
    return node


def swap_module(node: Any, old: type, new: type) -> Any:
    """``node`` with every reference to the class ``old`` replaced by ``new`` (how the CPU
    rehearsal's stand-ins get into a spec)."""
    return map_spec(node, lambda part: new if part is old else part)


def spec_parts(node: Any) -> list[Any]:
    """Every part :func:`map_spec` visits in ``node``, top down (``node`` first)."""
    parts: list[Any] = []
    map_spec(node, lambda part: parts.append(part) or part)
    return parts


def _same(new: Any, old: Any) -> bool:
    return all(a is b for a, b in zip(new, old, strict=True))
