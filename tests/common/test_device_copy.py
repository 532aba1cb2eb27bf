"""Tier: pure (torch) on CPU; GPU where one is present. A host tensor for a CPU tensor is itself (no
copy); for a CUDA tensor it arrives on that device with the same values."""

import pytest
import torch

from megatron_ext.common.device_copy import host_to_device


def test_on_the_cpu_the_host_tensor_is_used_as_is() -> None:
    host = torch.tensor([0, 256, 512])
    assert host_to_device(host, torch.zeros(2)) is host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_like_gets_the_values_on_its_device() -> None:
    host = torch.arange(5)
    like = torch.zeros(1, device="cuda")
    copied = host_to_device(host, like)
    assert copied.device == like.device
    assert torch.equal(copied.cpu(), host)
