"""Tier: pure (torch). The stand-in of Transformer Engine's ``thd_get_partitioned_indices`` against
an independent reimplementation of TE's kernel written here from its per-token definition
(NVIDIA/TransformerEngine 2.x, ``transformer_engine/common/fused_attn/context_parallel.cu``,
``thd_partition_indices_kernel`` and ``binary_search``), a hand-worked case, the union over ranks,
and the compat row that binds it into ``megatron.core.utils.tex`` under ``--cpu``.
"""

import random

import pytest
import torch

from megatron_ext.common.thd_partition import thd_partitioned_indices
from tests.import_probe import imported_from


def _kernel_reference(cu: list[int], total: int, world: int, rank: int) -> list[int]:
    """TE's kernel, one thread per output token, transcribed literally (int arithmetic)."""
    batch = len(cu) - 1
    cu_s = [c // world for c in cu]  # the kernel asserts c % (2 * world) == 0 first

    def binary_search(target: int, array: list[int], length: int) -> int:
        left, right = 1, length - 1
        while left < right:
            mid = (left + right) // 2
            if array[mid] <= target:
                left = mid + 1
            else:
                right = mid
        return left - 1

    out = []
    for token_id in range(total // world):
        seq_id = binary_search(token_id, cu_s, batch + 1)
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        index += cu_s[seq_id] * world + seq_len // 2 * offset
        out.append(index)
    return out


def _random_row(rng: random.Random, world: int) -> tuple[list[int], int]:
    """Documents of multiples of 2 * world, some empty (repeated boundaries, as a flattened
    micro-batch's trailing entries are)."""
    lengths = [rng.choice([0, 1, 1, 2, 3, 5]) * 2 * world for _ in range(rng.randint(1, 7))]
    if sum(lengths) == 0:
        lengths.append(2 * world)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, cu[-1]


def test_pure_module_never_imports_megatron_or_a_feature_package() -> None:
    features = ("data", "moe", "replay", "training", "cpu", "compat")
    found = imported_from(
        ["megatron_ext.common.thd_partition"],
        ["megatron", *(f"megatron_ext.{f}" for f in features)],
    )
    assert found == []


def test_hand_worked_documents_of_8_and_4_tokens_at_cp_2() -> None:
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    # Doc 0 in chunks of 2: rank 0 chunks 0, 3; rank 1 chunks 1, 2. Doc 1 in chunks of 1.
    assert thd_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert thd_partitioned_indices(cu, 12, 2, 0).dtype == torch.int32


@pytest.mark.parametrize("world", [2, 4])
def test_equals_the_kernel_and_ranks_partition_the_row(world: int) -> None:
    rng = random.Random(world)
    several_docs = 0
    for _ in range(60):
        cu, total = _random_row(rng, world)
        several_docs += sum(b > a for a, b in zip(cu, cu[1:], strict=False)) > 1
        cu_t = torch.tensor(cu, dtype=torch.int32)
        parts = []
        for rank in range(world):
            ours = thd_partitioned_indices(cu_t, total, world, rank)
            assert ours.tolist() == _kernel_reference(cu, total, world, rank), (cu, rank)
            parts.append(ours)
        # Every token of the row on exactly one rank.
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(total, dtype=torch.int32))
    assert several_docs > 20  # the interesting case (documents in order, empty ones) occurred


def test_a_flattened_micro_batch_with_trailing_empty_segments() -> None:
    # Two samples of S = 8, padded cu_seqlens flattened sync-free (data/batch.py): [0 4 8 8 | 8 16].
    cu = torch.tensor([0, 4, 8, 8, 8, 16], dtype=torch.int32)
    assert thd_partitioned_indices(cu, 16, 2, 1).tolist() == [1, 2, 5, 6, 10, 11, 12, 13]


@pytest.mark.parametrize(
    ("cu", "total", "world", "match"),
    [
        ([0, 6, 8], 8, 2, "6 is not divisible by 2 \\* --context-parallel-size \\(4\\)"),
        ([0, 8], 6, 2, "multiple of 2 \\* CP size"),
        ([0, 8], 8, 2, None),
    ],
)
def test_refuses_what_te_refuses(cu, total, world, match) -> None:
    cu_t = torch.tensor(cu, dtype=torch.int32)
    if match is None:  # positive control: the same call with valid arguments
        assert thd_partitioned_indices(cu_t, total, world, 0).numel() == total // world
        with pytest.raises(ValueError, match="int32"):
            thd_partitioned_indices(cu_t.long(), total, world, 0)
        return
    with pytest.raises(ValueError, match=match):
        thd_partitioned_indices(cu_t, total, world, 0)


def test_the_cpu_row_binds_it_into_megatron_and_is_needed() -> None:
    import megatron.core.utils as mcore_utils

    from megatron_ext import compat
    from megatron_ext.compat.patch import original

    (row,) = compat.rows("cpu.te_partition")
    # Still needed: without Transformer Engine, Megatron's get_batch_on_this_cp_rank finds None.
    assert original(row) is None
    with compat.patched_rows([row]):
        stand_in = mcore_utils.tex.thd_get_partitioned_indices
        cu = torch.tensor([0, 8, 12], dtype=torch.int32)
        assert stand_in(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
