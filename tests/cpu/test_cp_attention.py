"""Tier: gloo ranks (2, CP=2, Megatron's parallel state) and pure torch. The ``--cpu``
context-parallel attention stand-in against Megatron's own local ``DotProductAttention`` run on one
rank over the whole row (its per-document causal mask from data/batch.py): outputs and the
gradients of every rank's queries, keys and values, for a packed THD row split per document by
Megatron's ``get_batch_on_this_cp_rank`` (TE's partition index stood in) and for an ``sbhd`` batch
split by Megatron's per-sequence zigzag; GQA. Pure: the math module's hand-worked mask.
"""

import torch

from megatron_ext.testing import run_distributed
from tests.import_probe import imported_from

HEADS, GROUPS, DIM = 4, 2, 8  # GQA: 2 query heads per key/value group


def _config(cp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=DIM, context_parallel_size=cp,
        attention_dropout=0.0,
    )  # fmt: skip


def _qkv(total: int, batch: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, batch, HEADS, DIM), (total, batch, GROUPS, DIM), (total, batch, GROUPS, DIM)]
    return [torch.randn(s, generator=gen) for s in (*shapes, (total, batch, HEADS * DIM))]


def _reference(q, k, v, grad, mask):
    """Megatron's local DotProductAttention on the whole sequence (one rank, CP 1)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    attention = DotProductAttention(_config(1), 1, AttnMaskType.causal, "self")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _stand_in(q, k, v, grad, packed_seq_params):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.cpu.cp_attention import ContextParallelDotProductAttention

    attention = ContextParallelDotProductAttention(_config(2), 1, AttnMaskType.causal, "self")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, None, packed_seq_params=packed_seq_params)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _thd_check(cu_list: list[int]) -> dict:
    """One packed row: Megatron slices it per document, the stand-in attends on each rank."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_ext.common.thd_partition import thd_partitioned_indices
    from megatron_ext.data.batch import document_attention_mask

    total = cu_list[-1]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    q, k, v, grad = _qkv(total, 1, seed=3)
    ref_out, ref_grads = _reference(q, k, v, grad, document_attention_mask(cu[None], total))
    rank = parallel_state.get_context_parallel_rank()
    # Megatron's own slicing of a batch (THD [1, T], cu_seqlens [1, n]) with the CPU row's index.
    batch = {"tokens": torch.arange(total)[None], "cu_seqlens": cu[None], "cu_seqlens_padded": None}
    sliced = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
    )
    index = sliced["tokens"][0]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=total, max_seqlen_kv=total)  # fmt: skip
    local = [t[index, 0] for t in (q, k, v, grad)]  # THD: [t, heads, dim]
    out, grads = _stand_in(*local[:3], local[3], params)
    return {
        "index_is_ours": torch.equal(index, thd_partitioned_indices(cu, total, 2, rank).long()),
        "out": (out, ref_out[index, 0]),
        "grads": [(g, r[index, 0]) for g, r in zip(grads, ref_grads, strict=True)],
        "reference_nonzero": all(r.abs().sum() > 0 for r in ref_grads),
    }


def _sbhd_check(seq: int, batch: int) -> dict:
    from megatron.core import parallel_state

    from megatron_ext.common.token_positions import cp_zigzag_positions

    q, k, v, grad = _qkv(seq, batch, seed=5)
    ref_out, ref_grads = _reference(q, k, v, grad, None)  # Megatron's default causal mask
    index = cp_zigzag_positions(seq, 2, parallel_state.get_context_parallel_rank())
    out, grads = _stand_in(*(t[index] for t in (q, k, v, grad)), None)
    return {
        "out": (out, ref_out[index]),
        "grads": [(g, r[index]) for g, r in zip(grads, ref_grads, strict=True)],
    }


def _assert_equal_to_reference(result: dict) -> None:
    # fp32, the same products summed in another order (a gathered, reordered key axis; the key and
    # value gradients reduce-scattered over the 2 ranks): a few ulps of values of order 1.
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(*result["out"], **tol)
    for got, want in result["grads"]:
        torch.testing.assert_close(got, want, **tol)


def test_math_module_never_imports_megatron() -> None:
    assert imported_from(["megatron_ext.cpu.document_attention"], ["megatron"]) == []


def test_hand_worked_document_mask() -> None:
    from megatron_ext.cpu.document_attention import document_causal_allowed, segment_ids

    # cu_seqlens [0 4 8]: rank 1 of CP 2 holds [1 2 5 6]; the query at 5 sees keys 4 and 5.
    seg = segment_ids(torch.tensor([0, 4, 8], dtype=torch.int32), 8)
    allowed = document_causal_allowed(torch.tensor([1, 2, 5, 6]), seg)
    assert allowed[2].nonzero().flatten().tolist() == [4, 5]
    assert allowed[1].nonzero().flatten().tolist() == [0, 1, 2]


def test_cp2_thd_attention_and_gradients_equal_one_rank_over_the_row() -> None:
    # Documents of 12, 4 and 8 tokens, a 4-token tail pad and two empty segments (the trailing
    # repeats of a flattened micro-batch): every boundary a multiple of 2 * CP.
    cu = [0, 12, 16, 16, 24, 28, 28, 32]
    results = run_distributed(_thd_check, 2, cu, cp=2)
    assert all(r["index_is_ours"] and r["reference_nonzero"] for r in results)
    for result in results:
        _assert_equal_to_reference(result)


def test_cp2_sbhd_attention_equals_one_rank_under_the_zigzag() -> None:
    for result in run_distributed(_sbhd_check, 2, 16, 2, cp=2):
        _assert_equal_to_reference(result)
