"""Tier: pure torch. The backward-key marker: identity forward, viewless, key announced in backward."""

import torch

from megatron_ext.replay.backward_key import mark_backward_key


def test_marker_is_identity_and_announces_its_key_when_backward_starts():
    seen = []
    x = torch.randn(3, 4, requires_grad=True)
    marked_a = mark_backward_key(x * 2, seen.append, "mb0")
    marked_b = mark_backward_key(x * 3, seen.append, "mb1")
    assert torch.equal(marked_a, x * 2) and marked_a._base is None  # Megatron frees it by _base
    assert seen == []  # nothing announced in the forward
    marked_b.sum().backward()  # backwards in reverse order of the forwards
    marked_a.sum().backward()
    assert seen == ["mb1", "mb0"]
    assert torch.equal(x.grad, torch.full_like(x, 5.0))  # gradients pass through unchanged
