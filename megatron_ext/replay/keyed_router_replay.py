"""The ``RouterReplay`` subclass route replay swaps into routers, and which routers those are.

Megatron 0.19.2's ``TopKRouter`` asks its ``RouterReplay`` for the top-k (``get_replay_topk``);
:class:`KeyedRouterReplay` asks the binding instead, which looks the targets up by key. A
``HybridModel`` with pattern ``*E*E``::

    model_moe_layer_numbers(model)                      # [2, 4]: the E positions
    [r.layer_number for r in replayed_routers(model)]   # [2, 4] -> MoE ordinals 0, 1
"""

from collections.abc import Callable
from typing import Protocol

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_ext.replay.layout import moe_layer_numbers, moe_layer_numbers_from_hybrid_pattern

TopKFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RouteSource(Protocol):
    """What a :class:`KeyedRouterReplay` asks for its top-k (the route replay binding)."""

    def route(
        self,
        replay: "KeyedRouterReplay",
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: TopKFunction,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class KeyedRouterReplay(RouterReplay):
    """A ``RouterReplay`` whose targets come from a :class:`RouteSource` by key."""

    def __init__(self, binding: RouteSource, moe_ordinal: int, layer_number: int) -> None:
        super().__init__()
        self.binding = binding
        self.moe_ordinal = moe_ordinal
        self.layer_number = layer_number

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopKFunction | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays (or records) this layer's top-k for the current micro-batch key."""
        assert default_compute_topk is not None
        return self.binding.route(self, scores, topk, num_groups, group_topk, default_compute_topk)


def swap_in(router: TopKRouter, binding: RouteSource, moe_ordinal: int) -> KeyedRouterReplay:
    """Replaces ``router.router_replay`` (and its slot in Megatron's global list) with a
    :class:`KeyedRouterReplay` asking ``binding``; returns it."""
    # RouterReplay.__init__ appends itself to Megatron's global list: take the new one off the end
    # and put it in the old one's slot, so the list keeps construction order.
    old = router.router_replay
    new = KeyedRouterReplay(binding, moe_ordinal, router.layer_number)  # appended to the list
    instances = RouterReplay.global_router_replay_instances
    if old is not None and any(inst is old for inst in instances):
        instances.pop()
        instances[next(i for i, inst in enumerate(instances) if inst is old)] = new
    router.router_replay = new
    return new


def model_moe_layer_numbers(model: torch.nn.Module) -> list[int]:
    """The decoder's MoE layer numbers: a ``HybridModel`` from its layer pattern (its config's
    ``moe_layer_freq`` does not describe it), a ``GPTModel`` from ``moe_layer_freq``."""
    if isinstance(model, HybridModel):
        return moe_layer_numbers_from_hybrid_pattern(model.hybrid_layer_pattern)
    return moe_layer_numbers(model.config.num_layers, model.config.moe_layer_freq)


def replayed_routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The routers route replay binds: every decoder ``TopKRouter`` (MTP layers' excluded)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter) and not m.is_mtp_layer]


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside any wrappers that hold it as ``.module``."""
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return module
