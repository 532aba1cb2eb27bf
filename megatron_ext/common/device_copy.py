"""A small host tensor copied to the device without waiting for the stream (pure torch): the MoE
dispatcher's group starts and route replay's row positions, needed on the device every
micro-batch::

    start_E = host_to_device(torch.tensor([0, 256, 512]), routing)   # routing on cuda:0
"""

import torch


def host_to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A small host tensor on ``like``'s device without a stream sync (itself on the CPU)."""
    if like.is_cpu:
        return host
    # Pinned and asynchronous: a blocking or pageable copy would wait for the stream. The caching
    # host allocator keeps the pinned block until the copy has run.
    return host.pin_memory().to(like.device, non_blocking=True)
