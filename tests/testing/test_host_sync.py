"""Tier: pure (plus Megatron's moe_utils on one process). The host-sync detector flags what syncs on a GPU.

What 0.19.2 measures here: ``moe_utils.permute`` is argsort-based (no sync once ``num_out_tokens`` is
given); ``pad_routing_map`` assigns through a boolean mask (``routing_map[mask] = 1``: an ``index_put_``
that CUDA implements with ``nonzero``, a sync); ``sort_chunks_by_idxs`` calls ``.tolist()``.
"""

import pytest
import torch

from megatron_ext.testing import assert_no_host_sync, count_host_syncs


def _routing_map(num_tokens: int = 12, num_experts: int = 4) -> torch.Tensor:
    routing_map_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map_TE[torch.arange(num_tokens), torch.arange(num_tokens) % num_experts] = True
    return routing_map_TE


PLANTED = {
    ".item()": lambda t: t.sum().item(),
    ".tolist()": lambda t: t.tolist(),
    ".numpy()": lambda t: t.numpy(),
    ".cpu()": lambda t: t.cpu(),
    "bool(tensor)": lambda t: bool(t.sum() > 0),
    "int(tensor)": lambda t: int(t.sum()),
    "torch.equal": lambda t: torch.equal(t, t),
    "nonzero": lambda t: torch.nonzero(t),
    "masked_select": lambda t: t.masked_select(t > 0),
    "boolean-mask indexing": lambda t: t[t > 0],
    "unique": lambda t: torch.unique(t),
    "bincount": lambda t: torch.bincount(t.flatten().long().abs()),
    "repeat_interleave without output_size": lambda t: torch.repeat_interleave(
        torch.arange(3), torch.tensor([1, 2, 3])
    ),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_sync_is_flagged(name: str) -> None:
    x = torch.randn(6, 3)
    _, events = count_host_syncs(PLANTED[name], x)
    assert len(events) == 1, events  # one sync, counted once (no double count via its ATen ops)
    assert events[0].startswith(name), events
    assert "test_host_sync.py" in events[0]  # the report points at the caller's line
    with pytest.raises(AssertionError, match="made 1 host sync"):
        assert_no_host_sync(PLANTED[name], x)


def test_sync_free_ops_pass_and_results_come_back() -> None:
    counts_E = torch.tensor([3, 0, 5, 1])

    def sync_free(counts_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(counts_E, 0) - counts_E
        order = torch.argsort(counts_E, stable=True)
        expanded = torch.repeat_interleave(torch.arange(4), counts_E, output_size=9)
        return offsets_E + order + torch.zeros(4).scatter_add(0, expanded[:4], torch.ones(4)).long()

    out = assert_no_host_sync(sync_free, counts_E)
    assert out.shape == (4,)


def test_megatron_permute_is_sync_free_in_0_19() -> None:
    from megatron.core.transformer.moe import moe_utils

    x_TD = torch.randn(12, 8)
    permuted, *_ = assert_no_host_sync(moe_utils.permute, x_TD, _routing_map(), num_out_tokens=12)
    assert permuted.shape == (12, 8)


def test_megatron_pad_routing_map_is_flagged() -> None:
    from megatron.core.transformer.moe import moe_utils

    padded, events = count_host_syncs(moe_utils.pad_routing_map, _routing_map(), 16)
    assert padded.sum() > _routing_map().sum()  # it did pad (12 tokens cannot reach 16 per expert)
    assert events and events[0].startswith("boolean-mask indexing"), events
    assert "pad_routing_map" in events[0]


def test_megatron_sort_chunks_by_idxs_is_flagged() -> None:
    from megatron.core.transformer.moe import moe_utils

    x = torch.randn(6, 2)
    _, events = count_host_syncs(
        moe_utils.sort_chunks_by_idxs, x, torch.tensor([2, 4]), torch.tensor([1, 0])
    )
    assert any(e.startswith(".tolist()") for e in events), events


def test_detector_can_fail_the_assertion_it_is_used_for() -> None:
    # The detector itself is shown to fail on a planted sync inside otherwise sync-free code.
    def aligned_then_planted(counts_E: torch.Tensor) -> torch.Tensor:
        aligned_E = (counts_E + 15) // 16 * 16
        _ = int(aligned_E.sum())  # planted
        return aligned_E

    with pytest.raises(AssertionError, match="int\\(tensor\\)"):
        assert_no_host_sync(aligned_then_planted, torch.tensor([1, 17, 0]))


def test_to_cpu_of_a_cpu_tensor_is_not_a_sync_but_dot_cpu_is() -> None:
    # In CPU mode Megatron's `.to(torch.cuda.current_device())` becomes `.to("cpu")` on a CPU tensor:
    # a device-to-device no-op on a GPU, so not flagged. An explicit `.cpu()` states intent and is.
    x = torch.randn(3)
    assert count_host_syncs(lambda t: t.to("cpu"), x)[1] == []
    assert count_host_syncs(lambda t: t.to(device="cpu"), x)[1] == []
    assert len(count_host_syncs(lambda t: t.cpu(), x)[1]) == 1
