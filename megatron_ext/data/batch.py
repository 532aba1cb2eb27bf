"""Batch -> Megatron ``GPTModel.forward`` glue for packed, padded samples (sync-free).

A collated batch of :class:`~megatron_ext.data.packed_dataset.PackedDataset` samples carries
``padding_mask`` (True = pad) and padded ``cu_seqlens`` [B, S+1]. This module turns them into
what Megatron-Core 0.19.2 consumes:

- ``padding_mask`` goes to ``GPTModel.forward(padding_mask=...)`` unchanged: Megatron's router
  treats True as pad (``valid = ~padding_mask`` in ``compute_routing_scores_for_aux_loss``,
  ``routing_map & ~padding_mask`` in ``_apply_expert_bias``) although some docstrings say the
  opposite, so pads stay out of aux loss, z-loss and expert-bias counts.
- document boundaries become either ``PackedSeqParams`` (THD, for attention backends that read
  ``cu_seqlens``) or an equivalent causal per-document boolean mask [B, 1, S, S] (True = masked,
  Megatron's convention) for the local backend on CPU.

Example (two samples of S = 4; sample 0 = documents [2, 1] + 1 pad)::

    cu_seqlens = [[0, 2, 3, 4, 4], [0, 4, 4, 4, 4]]
    document_attention_mask(cu_seqlens, 4)[0, 0] ->  rows = queries, False = may attend
        [[F T T T], [F F T T], [T T F T], [T T T F]]
    packed_seq_params(cu_seqlens, 4).cu_seqlens_q -> [0, 2, 3, 4, 4, 8, 8, 8, 8]
    (trailing repeats are empty segments: no host sync is needed to trim them)

Samples of one micro-batch must share a length: Megatron's data loader stacks them with
``default_collate``, so micro-batch > 1 with packed data needs ``--pad-to-seq-len`` (the entry
point refuses ``--pack-documents`` without it there).

Legend: B samples in the micro-batch, S padded sample length, C = S + 1 cu_seqlens entries.
"""

from typing import Any, Literal

import torch
from megatron.core.packed_seq_params import PackedSeqParams

AttentionLayout = Literal["mask", "thd"]


def segment_ids(cu_seqlens_BC: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` index of the segment (document or pad run) holding each position."""
    pos_BS = torch.arange(seq_len, device=cu_seqlens_BC.device).expand(cu_seqlens_BC.shape[0], -1)
    bounds = cu_seqlens_BC[:, 1:].to(pos_BS.dtype).contiguous()
    return torch.searchsorted(bounds, pos_BS.contiguous(), right=True)


def document_attention_mask(cu_seqlens_BC: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Causal attention restricted to each segment: ``[B, 1, S, S]`` bool, True = masked."""
    seg_BS = segment_ids(cu_seqlens_BC, seq_len)
    pos_S = torch.arange(seq_len, device=cu_seqlens_BC.device)
    causal_SS = pos_S[:, None] >= pos_S[None, :]
    allowed_BSS = (seg_BS[:, :, None] == seg_BS[:, None, :]) & causal_SS
    return ~allowed_BSS.unsqueeze(1)


def flat_cu_seqlens(
    cu_seqlens_BC: torch.Tensor, seq_len: int, drop_empty: bool = False
) -> torch.Tensor:
    """The segment boundaries of the batch flattened to one row of ``B * S`` tokens: 1-D int32
    ``[B * S + 1]`` on ``cu_seqlens_BC``'s device, without a host read (a sample's trailing repeats
    stay, as empty segments). ``drop_empty``: without them (only where the tensor is on the host,
    where reading it costs no device sync); the same segments, the same THD split and attention."""
    batch = cu_seqlens_BC.shape[0]
    offsets_B1 = torch.arange(batch, device=cu_seqlens_BC.device)[:, None] * seq_len
    starts = (cu_seqlens_BC[:, :-1].to(torch.int64) + offsets_B1).reshape(-1)
    total = torch.full((1,), batch * seq_len, dtype=torch.int64, device=cu_seqlens_BC.device)
    flat = torch.cat([starts, total]).to(torch.int32)
    if drop_empty:
        if flat.device.type != "cpu":
            raise ValueError("drop_empty reads the boundaries: only for host tensors (no sync)")
        flat = torch.unique_consecutive(flat)
    return flat


def packed_seq_params(
    cu_seqlens_BC: torch.Tensor, seq_len: int, drop_empty: bool = False
) -> PackedSeqParams:
    """THD ``PackedSeqParams`` for the batch flattened to one row of ``B * S`` tokens.

    ``max_seqlen`` is the static bound ``S`` (reading the true maximum would sync). ``drop_empty``:
    see :func:`flat_cu_seqlens`.
    """
    cu = flat_cu_seqlens(cu_seqlens_BC, seq_len, drop_empty)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=seq_len,
        max_seqlen_kv=seq_len,
    )


def gpt_forward_kwargs(
    batch: dict[str, torch.Tensor],
    *,
    layout: AttentionLayout = "mask",
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Keyword arguments for Megatron ``GPTModel.forward`` / ``HybridModel.forward`` from a
    collated batch.

    Args:
        batch: ``tokens``, ``labels``, ``position_ids``, ``padding_mask`` [B, S] and, for packed
            samples, ``cu_seqlens`` [B, S+1] (as :class:`PackedDataset` returns them, collated).
            Without ``cu_seqlens`` (``SelfPaddedGPTDataset``: one sequence per sample) the
            batch's own ``attention_mask`` is passed on, or None (Megatron's causal mask).
        layout: ``"mask"``: [B, S] tensors with a per-document causal mask (local backend);
            ``"thd"``: one [1, B*S] row plus ``packed_seq_params`` (THD backends; packed only).
        model: The model chunk the forward runs (possibly wrapped). Needed under sequence
            parallelism: the routers then get this TP rank's slice of the pad mask where
            megatron-core 0.19.2 does not scatter it (:func:`shard_padding_mask`).

    Returns:
        ``input_ids``, ``position_ids``, ``attention_mask``, ``labels``, ``padding_mask`` and,
        for THD, ``packed_seq_params``.
    """
    if layout not in ("mask", "thd"):
        raise ValueError(f"unknown attention layout {layout!r}; choose 'mask' or 'thd'")
    tokens_BS = batch["tokens"]
    seq_len = tokens_BS.shape[1]
    kwargs: dict[str, Any] = {
        "input_ids": tokens_BS,
        "position_ids": batch["position_ids"],
        "labels": batch["labels"],
        "padding_mask": batch["padding_mask"].to(torch.bool),
    }
    if "cu_seqlens" not in batch:  # one sequence per sample: no document boundaries to pass
        if layout == "thd":
            raise ValueError(
                "layout='thd' needs packed samples (the batch has no 'cu_seqlens': build it with "
                "PackedDataset)"
            )
        kwargs["attention_mask"] = batch.get("attention_mask")
    elif layout == "mask":
        kwargs["attention_mask"] = document_attention_mask(batch["cu_seqlens"], seq_len)
    else:
        for key in ("input_ids", "position_ids", "labels", "padding_mask"):
            kwargs[key] = kwargs[key].reshape(1, -1)
        kwargs["attention_mask"] = None
        kwargs["packed_seq_params"] = packed_seq_params(batch["cu_seqlens"], seq_len)
    return kwargs if model is None else shard_padding_mask(kwargs, model)


#: The tensors Megatron's ``get_batch_on_this_cp_rank`` slices per document.
_MEGATRON_CP_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def context_parallel_inputs(
    batch: dict[str, torch.Tensor], cp_group: Any, drop_empty: bool = False
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """This context-parallel rank's share of a collated micro-batch, split by Megatron's own
    ``get_batch_on_this_cp_rank`` (megatron/core/utils.py, 0.19.2), as model inputs (sync-free).

    Packed samples (``cu_seqlens``): the micro-batch flattened to THD's one row ``[1, B*S]``
    (:func:`flat_cu_seqlens`, not Megatron's ``flatten_batch_for_packed_sequences``, which reads
    the device), Megatron's per-document split of ``tokens, labels, loss_mask, position_ids`` with
    Transformer Engine's ``thd_get_partitioned_indices`` (``megatron.core.utils.tex``; stood in under
    ``--cpu``), and the pad mask sliced with the same index. Every document boundary must be a
    multiple of ``2 * cp`` (the packs pad each document so). The ``PackedSeqParams`` stay global:
    TE's attention and Megatron's THD RoPE divide by the CP size themselves.
    Otherwise (one sequence per sample): Megatron's per-sequence zigzag, of every ``[B, S]`` tensor.
    ``drop_empty`` (the ``--cpu`` rehearsal, whose device is the host): the row's empty segments
    dropped (:func:`flat_cu_seqlens`). There Megatron's unfused THD RoPE
    (``_apply_rotary_pos_emb_thd``) loops over every segment in Python, and a micro-batch's trailing
    repeats are ``B * S`` mostly empty ones: a 768-token CP step took 20x longer with them.

    Returns:
        ``GPTModel.forward`` keyword arguments (as :func:`gpt_forward_kwargs`), this rank's loss
        mask in the same layout, and the THD partition index (int32, positions of the flattened
        row this rank holds: route replay slices the routes with it) or None.
    """
    from megatron.core import utils as mcore_utils

    tokens_BS = batch["tokens"]
    batch_size, seq_len = tokens_BS.shape
    if "cu_seqlens" not in batch:
        keys = (*_MEGATRON_CP_KEYS, "padding_mask", "attention_mask")
        split = {k: batch[k] for k in keys if batch.get(k) is not None}
        split = mcore_utils.get_batch_on_this_cp_rank(
            {**split, "cu_seqlens": None}, is_hybrid_cp=False, cp_group=cp_group
        )
        kwargs = {
            "input_ids": split["tokens"],
            "position_ids": split["position_ids"],
            "attention_mask": split.get("attention_mask"),
            "labels": split["labels"],
        }
        if "padding_mask" in split:
            kwargs["padding_mask"] = split["padding_mask"].to(torch.bool)
        return kwargs, split["loss_mask"], None
    params = packed_seq_params(batch["cu_seqlens"], seq_len, drop_empty)
    row = {k: batch[k].reshape(1, -1) for k in _MEGATRON_CP_KEYS}
    split = mcore_utils.get_batch_on_this_cp_rank(
        {**row, "cu_seqlens": params.cu_seqlens_q[None], "cu_seqlens_padded": None},
        is_hybrid_cp=False,
        cp_group=cp_group,
    )
    # The same index Megatron sliced with (its kernel is deterministic): for every other token.
    index_N = mcore_utils.tex.thd_get_partitioned_indices(
        params.cu_seqlens_q, batch_size * seq_len, cp_group.size(), cp_group.rank()
    )
    kwargs = {
        "input_ids": split["tokens"],
        "position_ids": split["position_ids"],
        "labels": split["labels"],
        "padding_mask": batch["padding_mask"].reshape(1, -1).index_select(1, index_N).bool(),
        "attention_mask": None,
        "packed_seq_params": params,
    }
    return kwargs, split["loss_mask"], index_N


def shard_padding_mask(kwargs: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Under sequence parallelism, gives the routers this TP rank's slice of the pad mask where
    megatron-core 0.19.2 does not.

    ``GPTModel`` scatters ``padding_mask`` along the sequence with the embedding output, but only
    on the stage that embeds (``pre_process``): a later pipeline stage passes it on whole.
    ``HybridModel.forward`` never scatters it. There every MoE router (aux losses, z-loss,
    expert-bias counts) would see S tokens of mask for S/TP tokens and fail on the shapes; the
    scatter Megatron's GPTModel applies is applied here instead.
    """
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.utils import unwrap_model

    inner = unwrap_model(model)  # DDP / Float16Module wrappers
    mask = kwargs.get("padding_mask")
    if mask is None or not inner.config.sequence_parallel:
        return kwargs
    if getattr(inner, "pre_process", True) and not isinstance(inner, HybridModel):
        return kwargs  # GPTModel's embedding stage scatters it itself
    from megatron.core import tensor_parallel

    scattered = tensor_parallel.scatter_to_sequence_parallel_region(
        mask.transpose(0, 1).contiguous()
    )
    return {**kwargs, "padding_mask": scattered.transpose(0, 1).contiguous()}


def masked_mean_loss(per_token_loss_BS: torch.Tensor, loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """Mean loss over the positions whose ``loss_mask`` is 1 (pads and prompts excluded)."""
    mask = loss_mask_BS.reshape(per_token_loss_BS.shape).to(per_token_loss_BS.dtype)
    return (per_token_loss_BS * mask).sum() / mask.sum().clamp_min(1.0)
