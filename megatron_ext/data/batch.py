"""Batch -> Megatron ``GPTModel.forward`` inputs for packed, padded samples (sync-free).

``padding_mask`` (True = pad) goes to the routers unchanged; ``cu_seqlens`` [B, S+1] becomes THD
``PackedSeqParams`` or a per-document causal mask (True = masked). Two samples of S = 4, sample 0
holding documents [2, 1] and 1 pad::

    cu_seqlens = [[0, 2, 3, 4, 4], [0, 4, 4, 4, 4]]
    document_attention_mask(cu_seqlens, 4)[0, 0] ->  rows = queries, False = may attend
        [[F T T T], [F F T T], [T T F T], [T T T F]]
    packed_seq_params(cu_seqlens, 4).cu_seqlens_q -> [0, 2, 3, 4, 4, 8, 8, 8, 8]

Legend: B samples in the micro-batch, S padded sample length, C = S + 1 cu_seqlens entries.
"""

from typing import Any, Literal

import torch
from megatron.core.packed_seq_params import PackedSeqParams

AttentionLayout = Literal["mask", "thd"]


def segment_ids(cu_seqlens_BC: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` index of the segment (document or pad run) holding each position."""
    # Trailing repeats of cu_seqlens are empty segments: searchsorted skips them, no host read.
    pos_BS = torch.arange(seq_len, device=cu_seqlens_BC.device).expand(cu_seqlens_BC.shape[0], -1)
    bounds = cu_seqlens_BC[:, 1:].to(pos_BS.dtype).contiguous()
    return torch.searchsorted(bounds, pos_BS.contiguous(), right=True)


def document_attention_mask(cu_seqlens_BC: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Causal attention restricted to each segment: ``[B, 1, S, S]`` bool, True = masked."""
    seg_BS = segment_ids(cu_seqlens_BC, seq_len)
    pos_S = torch.arange(seq_len, device=cu_seqlens_BC.device)
    causal_SS = pos_S[:, None] >= pos_S[None, :]  # [S, S] broadcast: no host read, no loop
    allowed_BSS = (seg_BS[:, :, None] == seg_BS[:, None, :]) & causal_SS
    return ~allowed_BSS.unsqueeze(1)


def flat_cu_seqlens(
    cu_seqlens_BC: torch.Tensor, seq_len: int, drop_empty: bool = False
) -> torch.Tensor:
    """The batch's segment boundaries as one row of ``B * S`` tokens: int32 ``[B * S + 1]``;
    ``drop_empty`` (host tensors only) drops the empty segments."""
    # A sample's trailing repeats stay, as empty segments: trimming them would read the device.
    # Either way the THD split and the attention are the same.
    batch = cu_seqlens_BC.shape[0]
    # Sample b's boundaries shifted by b * S; every sample's last entry (S) is the next's first.
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
    """THD ``PackedSeqParams`` of the batch as one row (``drop_empty``: :func:`flat_cu_seqlens`)."""
    cu = flat_cu_seqlens(cu_seqlens_BC, seq_len, drop_empty)
    # max_seqlen is the static bound S: reading the true maximum would sync.
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
    """Keyword arguments for Megatron ``GPTModel.forward`` / ``HybridModel.forward``.

    Args:
        batch: ``tokens``, ``labels``, ``position_ids``, ``padding_mask`` [B, S] and, for packed
            samples, ``cu_seqlens`` [B, S+1]; else its ``attention_mask`` (or None) is passed on.
        layout: ``"mask"``: [B, S] tensors with a per-document causal mask (local backend);
            ``"thd"``: one [1, B*S] row plus ``packed_seq_params`` (THD backends; packed only).
        model: The model chunk the forward runs (possibly wrapped); needed under sequence
            parallelism (:func:`shard_padding_mask`).
    """
    if layout not in ("mask", "thd"):
        raise ValueError(f"unknown attention layout {layout!r}; choose 'mask' or 'thd'")
    tokens_BS = batch["tokens"]
    seq_len = tokens_BS.shape[1]
    kwargs: dict[str, Any] = {
        "input_ids": tokens_BS,
        "position_ids": batch["position_ids"],
        "labels": batch["labels"],
        # Megatron's routers read True as pad (``valid = ~padding_mask`` in
        # compute_routing_scores_for_aux_loss, ``routing_map & ~padding_mask`` in
        # _apply_expert_bias; some of its docstrings say the opposite): pads stay out of the aux
        # loss, z-loss and expert-bias counts.
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
    """This context-parallel rank's share of a collated micro-batch, as model inputs (sync-free).

    Split by Megatron's own ``get_batch_on_this_cp_rank`` (megatron/core/utils.py, 0.19.2): packed
    samples per document on THD's one row ``[1, B*S]`` (every document boundary a multiple of
    ``2 * cp``: the packs pad each document so), others by its per-sequence zigzag.

    Returns:
        ``GPTModel.forward`` keyword arguments (as :func:`gpt_forward_kwargs`), this rank's loss
        mask in the same layout, and the THD partition index (int32, positions of the flattened
        row this rank holds: route replay slices the routes with it) or None. ``drop_empty``: see
        :func:`flat_cu_seqlens`.
    """
    from megatron.core import utils as mcore_utils

    tokens_BS = batch["tokens"]
    batch_size, seq_len = tokens_BS.shape
    if "cu_seqlens" not in batch:
        return _zigzag_inputs(batch, cp_group)
    # Flattened by flat_cu_seqlens, not Megatron's flatten_batch_for_packed_sequences, which reads
    # the device. drop_empty is the --cpu rehearsal's (its device is the host): Megatron's unfused
    # THD RoPE (_apply_rotary_pos_emb_thd) loops over every segment in Python, and the trailing
    # repeats are B * S mostly empty ones (a 768-token CP step took 20x longer with them).
    # The PackedSeqParams stay global: TE's attention and Megatron's THD RoPE divide by the CP size.
    params = packed_seq_params(batch["cu_seqlens"], seq_len, drop_empty)
    row = {k: batch[k].reshape(1, -1) for k in _MEGATRON_CP_KEYS}
    split = mcore_utils.get_batch_on_this_cp_rank(
        {**row, "cu_seqlens": params.cu_seqlens_q[None], "cu_seqlens_padded": None},
        is_hybrid_cp=False,
        cp_group=cp_group,
    )
    # The same index Megatron sliced with (TE's thd_get_partitioned_indices through
    # megatron.core.utils.tex, stood in under --cpu; deterministic): for the pad mask, and routes.
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


def _zigzag_inputs(
    batch: dict[str, torch.Tensor], cp_group: Any
) -> tuple[dict[str, Any], torch.Tensor, None]:
    """One sequence per sample: Megatron's per-sequence zigzag of every ``[B, S]`` tensor."""
    from megatron.core import utils as mcore_utils

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


def shard_padding_mask(kwargs: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Under sequence parallelism, gives the routers this TP rank's slice of the pad mask where
    megatron-core 0.19.2 does not (else they see S tokens of mask for S/TP tokens)."""
    # GPTModel scatters padding_mask with the embedding output, but only on the stage that embeds
    # (pre_process): a later pipeline stage passes it on whole; HybridModel.forward never does.
    # GPTModel's own scatter is applied here instead.
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
    # clamp_min, not a host check: an all-masked micro-batch gives 0 without a sync.
    mask = loss_mask_BS.reshape(per_token_loss_BS.shape).to(per_token_loss_BS.dtype)
    return (per_token_loss_BS * mask).sum() / mask.sum().clamp_min(1.0)
