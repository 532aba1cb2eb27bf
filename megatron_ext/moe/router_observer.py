"""Records the routing of every Megatron ``TopKRouter`` of a model into :class:`ExpertLoadMetrics`.

``AlignedMoELayer`` records its own routing; this observer does the same for any model, including stock
``MoELayer`` ones (benchmarks and tests compare Megatron's path with ours). It reads the router's output
``routing_map`` and the ``padding_mask`` Megatron hands the router (already in the router's token order),
so pads are counted apart exactly as in ``AlignedMoELayer``. Device ops only.

Example::

    metrics = ExpertLoadMetrics(num_experts=8, ep_size=2)
    with observe_routers(model, metrics):
        model(tokens, position_ids, attention_mask=None, padding_mask=pad_mask)
    metrics.device_stats(dp_group)["rank_max_vio"]
"""

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.moe.load_metrics import ExpertLoadMetrics


@contextlib.contextmanager
def observe_routers(
    model: torch.nn.Module, metrics: ExpertLoadMetrics
) -> Iterator[ExpertLoadMetrics]:
    """Within the block, every forward of ``model``'s routers is recorded into ``metrics``.

    Raises:
        ValueError: ``model`` has no MoE router.
    """
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError("observe_routers: the model has no MoE layer (no TopKRouter)")

    def record(router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        padding_mask = inputs[1] if len(inputs) > 1 else None
        pad_mask_T = None if padding_mask is None else padding_mask.reshape(-1)
        metrics.record(router.layer_number, output[1].detach(), pad_mask_T)

    handles = [router.register_forward_hook(record) for router in routers]
    try:
        yield metrics
    finally:
        for handle in handles:
            handle.remove()
