"""Tier: pure (plus Megatron's moe_utils on one process). The host-sync detector flags what syncs on a GPU.

What 0.19.2 measures here: ``moe_utils.permute`` is argsort-based (no sync once ``num_out_tokens`` is
given); ``pad_routing_map`` assigns a Python scalar through one boolean mask (``routing_map[mask] = 1``),
which ATen's ``_index_put_impl_`` runs as ``masked_fill_`` (``canDispatchToMaskedFill``: one bool mask on
self's device, a one-element host value, no accumulate), so it is sync-free; ``sort_chunks_by_idxs``
calls ``.tolist()``.
"""

import numpy as np
import pytest
import torch

from megatron_ext.testing import assert_no_host_sync, count_host_syncs


def _routing_map(num_tokens: int = 12, num_experts: int = 4) -> torch.Tensor:
    routing_map_TE = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map_TE[torch.arange(num_tokens), torch.arange(num_tokens) % num_experts] = True
    return routing_map_TE


#: Two boolean indices of a [6, 3] tensor, selecting 2 positions each (they must broadcast).
TWO_MASKS = (torch.tensor([1, 0, 1, 0, 0, 0]).bool(), torch.tensor([1, 0, 1]).bool())

PLANTED = {
    ".item()": lambda t: t.sum().item(),
    ".tolist()": lambda t: t.tolist(),
    ".numpy()": lambda t: t.numpy(),
    ".cpu()": lambda t: t.cpu(),
    ".to('cpu')": lambda t: t.to("cpu"),
    ".to('cpu') ": lambda t: t.to(torch.device("cpu"), non_blocking=True),  # Megatron's D2H form
    ".to('cpu')  ": lambda t: t.to(device="cpu"),
    "np.asarray(tensor)": lambda t: np.asarray(t),
    "str(tensor)/repr(tensor)": lambda t: str(t),
    "str(tensor)/repr(tensor) ": lambda t: repr(t),
    "format(tensor)/f-string": lambda t: f"{t}",
    "format(tensor)/f-string ": lambda t: f"{t.sum():.3f}",  # a 0-d tensor formats its .item()
    "bool(tensor) ": lambda t: bool(t.any()),
    "bool(tensor)  ": lambda t: 1 if t.sum() > 0 else 0,  # an `if` on a tensor is bool(tensor)
    "bool(tensor)": lambda t: bool(t.sum() > 0),
    "int(tensor)": lambda t: int(t.sum()),
    "torch.equal": lambda t: torch.equal(t, t),
    "nonzero": lambda t: torch.nonzero(t),
    "masked_select": lambda t: t.masked_select(t > 0),
    "boolean-mask indexing": lambda t: t[t > 0],
    "boolean-mask indexing ": lambda t: t.clone().__setitem__(t > 0, t.sum()),  # device value
    "boolean-mask indexing  ": lambda t: t.clone().index_put_(
        (t > 0,), torch.tensor(1.0), accumulate=True
    ),
    "boolean-mask indexing   ": lambda t: t.clone().__setitem__(TWO_MASKS, 1.0),  # two indices
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
    assert events[0].startswith(name.strip()), events  # trailing spaces only keep the ids apart
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


def test_megatron_pad_routing_map_is_sync_free() -> None:
    """``routing_map[mask] = 1``: one bool mask and a Python scalar, ATen's masked_fill path."""
    from megatron.core.transformer.moe import moe_utils

    routing_map_TE = _routing_map(num_tokens=40)  # 10 tokens per expert
    padded = assert_no_host_sync(moe_utils.pad_routing_map, routing_map_TE.clone(), 16)
    assert padded.sum(0).tolist() == [16] * 4  # it did pad: 10 -> 16 tokens per expert


def test_mask_assignment_follows_atens_masked_fill_rule() -> None:
    x, mask = torch.randn(6, 4), torch.rand(6, 4) > 0.5
    assert mask.any()

    def syncs(fn) -> list[str]:
        return count_host_syncs(fn, x.clone())[1]

    # masked_fill path: one bool/uint8 mask, a Python scalar value, no accumulate.
    assert syncs(lambda t: t.__setitem__(mask, 1)) == []
    assert syncs(lambda t: t.__setitem__(mask, True)) == []
    assert syncs(lambda t: t.__setitem__((slice(None), mask[0]), 1.0)) == []  # [None, mask]
    assert syncs(lambda t: t.masked_fill_(mask, 1.0)) == []
    # On a device self (meta here), a one-element host tensor value is the same masked_fill.
    meta, meta_mask = (
        torch.empty(6, 4, device="meta"),
        torch.empty(6, 4, dtype=torch.bool, device="meta"),
    )
    assert count_host_syncs(lambda: meta.index_put_((meta_mask,), torch.tensor(1.0)))[1] == []
    # nonzero path, a sync: device-tensor value, accumulate, several indices, a row-vector value.
    assert len(syncs(lambda t: t.__setitem__(mask, t.sum()))) == 1
    values = torch.zeros(int(mask.sum()))
    assert len(syncs(lambda t: t.__setitem__(mask, values))) == 1
    assert len(syncs(lambda t: t.index_put_((mask,), torch.tensor(1.0), accumulate=True))) == 1
    two_masks = (torch.tensor([1, 0, 1, 0, 0, 0]).bool(), torch.tensor([1, 0, 1, 0]).bool())
    assert len(syncs(lambda t: t.__setitem__(two_masks, 1))) == 1
    # The scalar note does not leak: a later read through a mask in the same call still syncs.
    assert len(syncs(lambda t: (t.__setitem__(mask, 1), t[mask]))) == 1


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


def test_to_cpu_is_flagged_except_cpu_modes_device_placement_in_megatron() -> None:
    """On CPU every tensor stands for a device tensor, so ``.to("cpu")`` is a sync. The one
    exception: where CPU mode turns Megatron's ``torch.cuda.current_device()`` into ``"cpu"``
    (``megatron_ext.cpu.model_stack._CURRENT_DEVICE_USERS``), ``.to("cpu")`` is a device placement, a no-op
    on a GPU. Megatron's real device-to-host copy (``torch.device("cpu")``) stays flagged there."""
    from megatron_ext.cpu.model_stack import _CURRENT_DEVICE_USERS

    x = torch.randn(3)
    source = "def place(t):\n    return t.to(device='cpu')\n\ndef d2h(t):\n    return t.to(torch.device('cpu'))\n"

    def module_named(name: str) -> dict:
        namespace = {"__name__": name, "torch": torch}
        exec(compile(source, f"<{name}>", "exec"), namespace)
        return namespace

    router = module_named("megatron.core.transformer.moe.router")
    assert "megatron.core.transformer.moe.router" in _CURRENT_DEVICE_USERS
    assert count_host_syncs(router["place"], x)[1] == []
    assert len(count_host_syncs(router["d2h"], x)[1]) == 1
    elsewhere = module_named("megatron.core.transformer.moe.token_dispatcher")
    assert len(count_host_syncs(elsewhere["place"], x)[1]) == 1
    assert count_host_syncs(lambda t: t.to(torch.float64), x)[1] == []  # no device: no move
