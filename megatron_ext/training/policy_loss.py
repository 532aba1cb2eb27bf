"""The policy loss of an RL step on rollouts (pure torch, never imports megatron): a token-level
PPO-clip surrogate on the trainer's per-token log-probs against the behaviour (rollout engine's)
log-probs, with the metrics that say how far trainer and engine disagree.

Per trained token t (loss mask 1), with the trainer's log-prob ``logp`` of the token (minus
Megatron's per-token cross-entropy), the engine's ``old`` and the advantage ``A``::

    r_t     = exp(logp_t - old_t)                                  importance ratio
    loss_t  = -min(r_t * A_t, clip(r_t, 1 - low, 1 + high) * A_t)  (+ kl_coeff * k3_t)
    k3_t    = (r_t - 1) - log r_t                                   KL(behaviour || policy) estimate

Summed over the trained tokens and returned with their count (Megatron's loss contract: with
``--calculate-per-token-loss`` Megatron divides by the global batch's token count, the token-level
mean of DAPO, Yu et al. 2025, arXiv:2503.14476, eq. 8, whose clip-higher is ``high > low``). Pads
and prompt tokens (mask 0) contribute nothing, not even a NaN. Worked example, ``low = high =
0.2``: ``r = 1.5, A = +1`` -> ``-min(1.5, 1.2) = -1.2`` (clipped); ``r = 1.5, A = -1`` ->
``-min(-1.5, -1.2) = 1.5`` (not clipped).

Sidecar values sit at their token's position; the loss at position s predicts token s + 1, so
:func:`label_aligned` shifts them as the packer shifts the loss mask.

Legend: B samples of a micro-batch, S positions, N tokens (flattened).
"""

from dataclasses import dataclass

import torch

#: Metric names in Megatron's loss report (each ``[sum, count]``: Megatron averages over DP).
MISMATCH, CLIP_FRACTION, RATIO_MEAN, KL = (
    "rl/logprob_mismatch",
    "rl/clip_fraction",
    "rl/ratio_mean",
    "rl/kl_k3",
)


@dataclass(frozen=True)
class PolicyLoss:
    """One micro-batch's policy loss: ``loss`` (sum over trained tokens, differentiable),
    ``num_tokens`` (their count) and ``metrics`` (name -> sum over the trained tokens)."""

    loss: torch.Tensor
    num_tokens: torch.Tensor
    metrics: dict[str, torch.Tensor]


def label_aligned(values_BS: torch.Tensor) -> torch.Tensor:
    """Each position's value of the token it predicts (its label, the next token): ``values``
    shifted left by one along S, the last position 0 (it predicts nothing in its pack).

    Example: ``[[a b c d]] -> [[b c d 0]]``.
    """
    return torch.cat([values_BS[:, 1:], torch.zeros_like(values_BS[:, :1])], dim=1)


def ppo_clip_loss(
    logp_N: torch.Tensor,
    old_logp_N: torch.Tensor,
    advantages_N: torch.Tensor,
    mask_N: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_coeff: float = 0.0,
) -> PolicyLoss:
    """The token-level PPO-clip surrogate summed over the trained tokens (module docstring).

    Args:
        logp_N: The trainer's log-prob of each token (differentiable).
        old_logp_N: The behaviour policy's log-prob of each token.
        advantages_N: Each token's advantage.
        mask_N: 1 on trained tokens, 0 elsewhere (pads, prompts, a document's last position).
        clip_low: The ratio is clipped below at ``1 - clip_low``.
        clip_high: ... and above at ``1 + clip_high``.
        kl_coeff: Weight of the k3 KL estimate added to each token's loss (0: reported only).

    Returns:
        The :class:`PolicyLoss`; its metrics are sums over the trained tokens (divide by
        ``num_tokens``): ``|logp - old|``, clipped tokens, ratios, k3.
    """
    trained = mask_N > 0
    zero = torch.zeros_like(logp_N)
    # Untrained positions are zeroed before exp: a pad's garbage never becomes inf or NaN.
    delta = torch.where(trained, logp_N - old_logp_N.to(logp_N.dtype), zero)
    advantages = torch.where(trained, advantages_N.to(logp_N.dtype), zero)
    ratio = torch.exp(delta)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    k3 = (ratio - 1.0) - delta
    per_token = torch.maximum(unclipped, clipped)
    if kl_coeff:
        per_token = per_token + kl_coeff * k3
    weight = trained.to(logp_N.dtype)
    detached = delta.detach()
    metrics = {
        MISMATCH: (detached.abs() * weight).sum(),
        CLIP_FRACTION: ((clipped > unclipped).to(logp_N.dtype) * weight).sum().detach(),
        RATIO_MEAN: (ratio.detach() * weight).sum(),
        KL: (k3.detach() * weight).sum(),
    }
    return PolicyLoss(
        loss=(per_token * weight).sum(), num_tokens=weight.sum().detach(), metrics=metrics
    )
