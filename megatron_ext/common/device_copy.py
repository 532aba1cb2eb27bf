"""A small host tensor copied to the device without waiting for the stream (pure torch).

The MoE dispatcher's expert-group starts and route replay's row positions are computed on the host
and needed on the device every micro-batch; a blocking or pageable copy would synchronize the
stream each time. Example::

    start_E = host_to_device(torch.tensor([0, 256, 512]), routing)   # routing on cuda:0
"""

import torch


def host_to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A small host tensor on ``like``'s device without a stream sync (itself on the CPU).

    Pinned and copied asynchronously: a blocking or pageable host-to-device copy would wait
    for the stream. The caching host allocator keeps the pinned block until the copy has run.
    """
    if like.is_cpu:
        return host
    return host.pin_memory().to(like.device, non_blocking=True)
