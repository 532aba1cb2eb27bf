"""The RL policy loss in ``megatron_ext.pretrain_gpt`` (Megatron glue over
:mod:`~megatron_ext.training.policy_loss`): its sidecars in the packed dataset, its loss function in
the forward step, and record mode's log-prob sidecar (``--rl-record-logprobs``).

Per micro-batch the packed samples carry ``rl_advantages`` and ``rl_logprobs`` ``[B, S]`` (float32
sidecars gathered and self-padded like the tokens, checked finite when the dataset is built),
shifted to their labels and, under context parallelism, sliced with the index Megatron's
``get_batch_on_this_cp_rank`` split the tokens with (the loss mask's layout); the model returns Megatron's per-token cross-entropy (vocab-parallel, whole on every TP rank), whose
negation is the trainer's log-prob of each label. The loss function returns Megatron's contract
``(sum over trained tokens, their count, report)``; the report holds ``lm loss`` (the rollouts'
negative log-likelihood), ``policy loss`` and the ``rl/*`` metrics, each ``[sum, count]``, so
Megatron logs their token means over the data-parallel ranks::

    loss_fn = loss_for_batch(args, batch, validate, loss_mask, cp_index)  # None without --rl-loss
    loss, num_tokens, report = loss_fn(output)    # report["rl/logprob_mismatch"] = [sum, count]
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from megatron_ext.data.packed_dataset import Sidecar
from megatron_ext.training import run_state
from megatron_ext.training.policy_config import PolicyLossConfig
from megatron_ext.training.policy_loss import label_aligned, ppo_clip_loss

#: Sample keys of the sidecars (``PackedDatasetConfig.sidecars`` names).
ADVANTAGES_KEY, LOGPROBS_KEY = "rl_advantages", "rl_logprobs"


def policy_sidecars(config: PolicyLossConfig) -> dict[str, Sidecar]:
    """The packed dataset's sidecars for ``config`` (none without --rl-loss); constant pads 0."""
    if config.rl_loss == "off":
        return {}
    return {
        ADVANTAGES_KEY: Sidecar(config.rl_advantages_suffix, width=1, fill=0, finite=True),
        LOGPROBS_KEY: Sidecar(config.rl_logprobs_suffix, width=1, fill=0, finite=True),
    }


def loss_for_batch(
    args: Any,
    batch: dict[str, torch.Tensor],
    validate: Callable,
    loss_mask: torch.Tensor,
    cp_index: torch.Tensor | None = None,
) -> Any:
    """The micro-batch's loss function under --rl-loss (``batch``: on the device), else None.

    Args:
        validate: ``validate(loss, view)``, the forward step's loss guards (Megatron's rerun machine).
        loss_mask: The loss mask in the model's token order (this CP rank's share under CP).
        cp_index: Under context parallelism, the positions of the flattened ``[1, B*S]`` row this
            rank holds (the index Megatron split the tokens with); None otherwise.
    """
    config = run_state.configs(args)[PolicyLossConfig]
    if config.rl_loss == "off":
        return None
    # Bound, not computed: only the last pipeline stage calls it (the others may hold no batch).
    return partial(policy_loss_func, config, batch, loss_mask, cp_index, validate)


def _label_aligned_share(
    batch: dict[str, torch.Tensor], key: str, cp_index: torch.Tensor | None
) -> torch.Tensor:
    """Sidecar ``key`` at the positions that predict each token, in the loss mask's layout."""
    # The sidecars hold each token's value at its position; the loss at s predicts token s + 1,
    # so they are shifted in the whole pack, before the CP split moves a label to another rank.
    return _rank_share(label_aligned(batch[key].reshape(batch["tokens"].shape).float()), cp_index)


def _rank_share(values_BS: torch.Tensor, cp_index: torch.Tensor | None) -> torch.Tensor:
    """``values`` flattened in the model's token order: this CP rank's share of the THD row."""
    if cp_index is None:
        return values_BS.reshape(-1)
    return values_BS.reshape(-1).index_select(0, cp_index)


def policy_loss_func(
    config: PolicyLossConfig,
    batch: dict[str, torch.Tensor],
    loss_mask: torch.Tensor,
    cp_index: torch.Tensor | None,
    validate: Callable,
    output_tensor: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss contract for the policy loss: ``(sum, token count, report)`` of this rank's
    tokens (Megatron sums both over data- and context-parallel ranks), the local sum validated
    (``validate``) as the language-model loss is. ``loss_mask`` and the per-token loss
    ``output_tensor`` are in the model's token order (this CP rank's share: ``cp_index``)."""
    from megatron.training import get_args

    logp_N = -output_tensor.reshape(-1).float()
    mask_N = loss_mask.reshape(-1).float()
    result = ppo_clip_loss(
        logp_N,
        _label_aligned_share(batch, LOGPROBS_KEY, cp_index),
        _label_aligned_share(batch, ADVANTAGES_KEY, cp_index),
        mask_N,
        clip_low=config.rl_clip_low,
        clip_high=config.rl_clip_high,
        kl_coeff=config.rl_kl_coeff,
    )
    validate(result.loss, run_state.state(get_args()).parsed)
    count = result.num_tokens.to(torch.int).view(1)
    nll = (-logp_N.detach() * mask_N).sum()
    report = {
        "lm loss": torch.cat([nll.view(1), count]),
        "policy loss": torch.cat([result.loss.detach().view(1), count]),
        **{name: torch.cat([value.view(1), count]) for name, value in result.metrics.items()},
    }
    return result.loss, count[0], report


def record_logprobs(
    args: Any,
    output: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cp_index: torch.Tensor | None = None,
) -> None:
    """Record mode with --rl-record-logprobs: keeps each pack's per-token log-probs (minus the
    forward's cross-entropy) for its documents, on global rank 0's data-parallel group (the
    other groups computed the same packs). Under context parallelism (``cp_index``: this rank's
    positions of the THD row) the CP ranks first put their shares back together.

    NOTE: device-to-host sync (the log-probs and pack indices); record mode only.
    """
    run = run_state.state(args)
    if run.configs[PolicyLossConfig].rl_record_logprobs is None:
        return
    shape = batch["tokens"].shape
    logp_N = -output.detach().float().reshape(-1)
    if cp_index is not None:  # every CP rank takes part, recording or not
        logp_N = _whole_row(logp_N, cp_index, shape.numel())
    if not _records():
        return
    if run.logprob_recorder is None:
        from megatron_ext.training.logprob_record import LogprobRecorder

        run.logprob_recorder = LogprobRecorder(run.record_dataset.dataset.tokens.sequence_lengths)
    logp_BS = logp_N.reshape(shape).cpu().numpy()
    dataset = run.record_dataset
    for b, pack in enumerate(batch["pack_index"].tolist()):
        run.logprob_recorder.add_pack(
            dataset.pack_pieces(pack), logp_BS[b], dataset.config.doc_pad_multiple
        )


def _whole_row(share_N: torch.Tensor, cp_index: torch.Tensor, numel: int) -> torch.Tensor:
    """The THD row's values from every context-parallel rank's share: Megatron's per-document split
    gives each position to exactly one CP rank, so a sum over the group of zero-filled rows is it."""
    from megatron.core import parallel_state

    row = torch.zeros(numel, dtype=share_N.dtype, device=share_N.device)
    row.index_copy_(0, cp_index.to(torch.long), share_N)
    torch.distributed.all_reduce(row, group=parallel_state.get_context_parallel_group())
    return row


def finish_logprobs(args: Any) -> int | None:
    """Writes the recorded log-probs on global rank 0 from its data-parallel group (a gather over
    it; every rank calls this); returns the documents written there, else None."""
    run = run_state.state(args)
    config = run.configs[PolicyLossConfig]
    if config.rl_record_logprobs is None or not _records():
        return None
    from megatron_ext.training.logprob_record import LogprobRecorder

    recorder = run.logprob_recorder or LogprobRecorder(
        run.record_dataset.dataset.tokens.sequence_lengths
    )
    parts = [recorder.values]
    if torch.distributed.is_initialized():
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        rank0 = torch.distributed.get_rank() == 0
        gathered = [None] * torch.distributed.get_world_size(group) if rank0 else None
        torch.distributed.gather_object(recorder.values, gathered, dst=0, group=group)
        if not rank0:
            return None
        parts = gathered
    for values in parts:  # data-parallel rank order: a document recorded twice keeps the last
        recorder.merge(values)
    return _write(config.rl_record_logprobs, recorder, run.record_dataset.dataset.tokens)


def _records() -> bool:
    """Whether this rank is in global rank 0's data-parallel group (the one that records)."""
    if not torch.distributed.is_initialized():
        return True
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    return 0 in torch.distributed.get_process_group_ranks(group)


def _write(prefix: str, recorder: Any, tokens: Any) -> int:
    from megatron_ext.data.indexed_writer import write_token_sidecar

    return write_token_sidecar(
        prefix, recorder.documents(), tokens.path_prefix, tokens.sequence_lengths,
        name="logprobs", scope="token",
    )  # fmt: skip
