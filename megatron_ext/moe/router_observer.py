"""Records the routing of every Megatron ``TopKRouter`` of a model into :class:`ExpertLoadMetrics`
(``with observe_routers(model, metrics): model(...)``): what ``AlignedMoELayer`` records of itself,
for any model (benchmarks and tests compare Megatron's path with ours). Device ops only.
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
    """Within the block, every forward of ``model``'s routers (ValueError: none) is recorded
    into ``metrics``."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError("observe_routers: the model has no MoE layer (no TopKRouter)")

    def record(router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        # The padding_mask Megatron hands the router is in the router's token order already.
        padding_mask = inputs[1] if len(inputs) > 1 else None
        pad_mask_T = None if padding_mask is None else padding_mask.reshape(-1)
        metrics.record(router.layer_number, output[1].detach(), pad_mask_T)

    handles = [router.register_forward_hook(record) for router in routers]
    try:
        yield metrics
    finally:
        for handle in handles:
            handle.remove()
