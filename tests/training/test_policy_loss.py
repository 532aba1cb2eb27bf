"""Tier: pure (torch only). The PPO-clip policy loss against a reference written here from the
formula's definition, token by token in Python floats:

DAPO (Yu et al. 2025, arXiv:2503.14476), eq. 8: the token-level objective
``sum_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) / sum |o_i|`` with
``r_t = pi_theta(o_t) / pi_old(o_t)`` (the loss is its negation); the clip fraction as verl's
``compute_policy_loss`` reports it (verl/trainer/ppo/core_algos.py: the share of tokens whose
clipped loss exceeds the unclipped one); k3 = (r - 1) - log r (Schulman, "Approximating KL
Divergence", 2020).
"""

import math

import pytest
import torch

from megatron_ext.training.policy_loss import (
    CLIP_FRACTION,
    KL,
    MISMATCH,
    RATIO_MEAN,
    label_aligned,
    ppo_clip_loss,
)

LOW, HIGH = 0.2, 0.28

# Tokens chosen to hit every case (ratio r = exp(logp - old)):
#   0: r = 1.5,  A = +1  clipped above (1.28)      1: r = 1.5,  A = -1  not clipped
#   2: r = 0.5,  A = -2  clipped below (0.8)       3: r = 0.5,  A = +2  not clipped
#   4: r = 1.1,  A = +3  inside the range          5: r = 0.9,  A = -0.5 inside the range
#   6: r = 1.25, A = +1  inside (below 1.28, above 1.2: only clip-higher keeps it unclipped)
#   7: a pad: garbage log-probs, mask 0            8: a prompt token: mask 0, NaN-free huge gap
RATIOS = [1.5, 1.5, 0.5, 0.5, 1.1, 0.9, 1.25, 1.0, 1.0]
ADVANTAGES = [1.0, -1.0, -2.0, 2.0, 3.0, -0.5, 1.0, 7.0, -9.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 0, 0]
OLD = [-1.0, -2.0, -0.5, -3.0, -1.5, -0.7, -2.2, -1.0, -1.0]


def _reference(logp, old, adv, mask, low, high, kl_coeff):
    """Per token, in Python floats, from the definitions in the module docstring."""
    total = mismatch = clipped_tokens = ratios = kl = 0.0
    grads, flags = [], []
    count = 0
    for lp, o, a, m in zip(logp, old, adv, mask, strict=True):
        if not m:
            grads.append(0.0)
            flags.append(False)
            continue
        count += 1
        r = math.exp(lp - o)
        surrogate = min(r * a, min(max(r, 1 - low), 1 + high) * a)
        k3 = (r - 1) - math.log(r)
        total += -surrogate + kl_coeff * k3
        # d/dlogp: the unclipped branch -A r is active unless the clipped one is strictly larger.
        clip_active = -min(max(r, 1 - low), 1 + high) * a > -r * a
        clipped_tokens += clip_active
        flags.append(clip_active)
        grads.append((0.0 if clip_active else -a * r) + kl_coeff * (r - 1))
        mismatch += abs(lp - o)
        ratios += r
        kl += k3
    return total, count, mismatch, clipped_tokens, ratios, kl, grads, flags


def _inputs():
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    logp[7] = 80.0  # a pad's garbage: exp(80 - old) is huge; masked out before exp
    logp[8] = -1e30
    return logp, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


@pytest.mark.parametrize(("low", "high", "kl_coeff"), [(LOW, HIGH, 0.0), (0.2, 0.2, 0.1)])
def test_ppo_clip_loss_equals_the_reference_token_by_token(low, high, kl_coeff) -> None:
    logp, old, adv, mask = _inputs()
    logp.requires_grad_(True)
    result = ppo_clip_loss(logp, old, adv, mask, clip_low=low, clip_high=high, kl_coeff=kl_coeff)
    total, count, mismatch, clipped, ratios, kl, grads, flags = _reference(
        logp.tolist(), OLD, ADVANTAGES, MASK, low, high, kl_coeff
    )
    result.loss.backward()
    # float64 throughout: agreement to rounding of a handful of exp/log.
    torch.testing.assert_close(result.loss.item(), total, rtol=1e-12, atol=1e-12)
    assert result.num_tokens.item() == count == 7
    metrics = {k: v.item() for k, v in result.metrics.items()}
    assert metrics[MISMATCH] == pytest.approx(mismatch, rel=1e-12)
    assert metrics[CLIP_FRACTION] == clipped
    assert metrics[RATIO_MEAN] == pytest.approx(ratios, rel=1e-12)
    assert metrics[KL] == pytest.approx(kl, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(grads, dtype=torch.float64))
    assert torch.isfinite(logp.grad).all()  # the pad's exp(80 + 1) never entered
    # The interesting cases happened: tokens 0 and 2 clipped (no surrogate gradient), 1 and 3 not.
    assert flags[:4] == [True, False, True, False]
    # -A r (+ the KL term's r - 1): token 1: 1.5 (+ 0.5 kl), token 3: -1 (- 0.5 kl).
    assert logp.grad[1].item() == pytest.approx(1.5 + 0.5 * kl_coeff)
    assert logp.grad[3].item() == pytest.approx(-1.0 - 0.5 * kl_coeff)
    # Clip-higher: token 6 (r = 1.25) is clipped at high 0.2 and not at 0.28.
    assert clipped == (2 if high == HIGH else 3)


def test_ratio_one_gives_the_policy_gradient_and_no_mismatch() -> None:
    """Behaviour log-probs equal to the trainer's: r = 1 everywhere, loss = -sum(A), mismatch 0,
    nothing clipped, k3 0 (what the real loop asserts at its first step)."""
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5, 9.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    result = ppo_clip_loss(logp, logp.detach(), adv, mask, clip_low=LOW, clip_high=HIGH)
    assert result.loss.item() == pytest.approx(0.5)
    assert result.metrics[MISMATCH].item() == 0.0
    assert result.metrics[CLIP_FRACTION].item() == 0.0
    assert result.metrics[RATIO_MEAN].item() == 3.0 and result.metrics[KL].item() == 0.0
    result.loss.backward()
    assert logp.grad.tolist() == [-1.0, 2.0, -0.5, 0.0]


def test_no_trained_token_is_a_zero_loss_with_a_zero_count() -> None:
    logp = torch.full((3,), float("nan"))
    result = ppo_clip_loss(logp, logp, logp, torch.zeros(3), clip_low=LOW, clip_high=HIGH)
    assert result.num_tokens.item() == 0 and result.loss.item() == 0.0
    assert all(v.item() == 0.0 for v in result.metrics.values())


def test_label_aligned_shifts_each_value_to_the_position_that_predicts_it() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    assert label_aligned(values).tolist() == [[2.0, 3.0, 4.0, 0.0], [6.0, 7.0, 8.0, 0.0]]
