"""Tier: gloo ranks. Megatron's real MoE GPTModel at EP=2 on CPU equals a dense pure-torch reference,
and its real-token results do not depend on what fills the pads.

For each dispatcher (alltoall, allgather): GPTModel (8 experts, top-2, local spec) forward + backward on two
ranks; the first MoE layer's output must equal sum_e prob_e(x) * expert_e(x) computed densely with all eight
experts' weights gathered over EP, and the experts' weight gradients from Megatron's backward must equal the
reference gradients from every rank's tokens. Not bitwise: fp32 throughout, the only difference is
summation order (Megatron sums the top-2 contributions after un-permuting, the reference sums 8 terms;
weight gradients sum both ranks' tokens in another order), so the bound is 16 eps x the largest entry
(measured at most 4.2).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.testing import run_distributed

#: fp32 machine epsilon; bounds below are multiples of it times the compared tensor's largest entry.
EPS32 = torch.finfo(torch.float32).eps


def _gather_experts(moe) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron.core import parallel_state

    fc1 = torch.stack([e.linear_fc1.weight.detach() for e in moe.experts.local_experts])
    fc2 = torch.stack([e.linear_fc2.weight.detach() for e in moe.experts.local_experts])
    group = parallel_state.get_expert_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    fc1_all, fc2_all = (
        [torch.empty_like(fc1) for _ in range(size)],
        [torch.empty_like(fc2) for _ in range(size)],
    )
    torch.distributed.all_gather(fc1_all, fc1, group=group)
    torch.distributed.all_gather(fc2_all, fc2, group=group)
    return torch.cat(fc1_all), torch.cat(fc2_all)  # [E, F, D], [E, D, F] in global expert order


def _all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _moe_vs_dense(dispatcher: str) -> dict:
    from megatron.core import parallel_state

    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config

    rank = torch.distributed.get_rank()
    model = build_tiny_gpt(tiny_moe_config(moe_token_dispatcher_type=dispatcher))
    moe = model.decoder.layers[0].mlp
    seen = {}
    moe.register_forward_hook(lambda m, i, o: seen.update(x=i[0], out=o[0]))
    moe.router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0], routing_map=o[1]))

    torch.manual_seed(100 + rank)  # different tokens per rank: the all-to-all really moves tokens
    tokens = torch.randint(0, 128, (2, 24))
    loss = model(tokens, torch.arange(24).expand(2, 24), attention_mask=None, labels=tokens)
    loss.sum().backward()

    fc1_EFD, fc2_EDF = _gather_experts(moe)
    x_TD = seen["x"].detach().reshape(-1, seen["x"].shape[-1])
    probs_TE = seen["probs"].detach()
    expert_out_ETD = torch.einsum(
        "edf,etf->etd", fc2_EDF, F.gelu(torch.einsum("efd,td->etf", fc1_EFD, x_TD))
    )
    reference_TD = torch.einsum("te,etd->td", probs_TE, expert_out_ETD)
    out_TD = seen["out"].detach().reshape(-1, x_TD.shape[-1])

    # Backward through the MoE layer alone, with a fixed upstream gradient, against reference grads built
    # from every rank's tokens (a local expert's gradient sums contributions from both ranks).
    moe.zero_grad()
    x_in = seen["x"].detach().requires_grad_(True)
    grad_out = torch.randn_like(x_in)
    out2, _ = moe(x_in)
    (out2 * grad_out).sum().backward()
    ref_fc1 = fc1_EFD.clone().requires_grad_(True)
    ref_fc2 = fc2_EDF.clone().requires_grad_(True)
    all_x = _all_gather_rows(x_TD)
    all_probs = _all_gather_rows(seen["probs"].detach())
    all_g = _all_gather_rows(grad_out.reshape(-1, x_TD.shape[-1]))
    hidden = F.gelu(torch.einsum("efd,td->etf", ref_fc1, all_x))
    ref_out = torch.einsum("te,etd->td", all_probs, torch.einsum("edf,etf->etd", ref_fc2, hidden))
    (ref_out * all_g).sum().backward()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = len(moe.experts.local_experts)
    own = slice(ep_rank * local, (ep_rank + 1) * local)
    got_fc1 = torch.stack([e.linear_fc1.weight.grad for e in moe.experts.local_experts])
    got_fc2 = torch.stack([e.linear_fc2.weight.grad for e in moe.experts.local_experts])
    return {
        "out_err": float((out_TD - reference_TD).abs().max()),
        "out_scale": float(reference_TD.abs().max()),
        "fc1_grad_err": float((got_fc1 - ref_fc1.grad[own]).abs().max()),
        "fc2_grad_err": float((got_fc2 - ref_fc2.grad[own]).abs().max()),
        "grad_scale": float(ref_fc1.grad[own].abs().max()),
        "fc2_grad_scale": float(ref_fc2.grad[own].abs().max()),
        "all_grads_finite": all(
            p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()
        ),
        "experts_hit_per_rank": [int(c) for c in seen["routing_map"].sum(0)],
        "local_experts": local,
    }


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_moe_layer_equals_dense_reference(dispatcher: str) -> None:
    for result in run_distributed(_moe_vs_dense, 2, dispatcher, ep=2):
        assert result["local_experts"] == 4
        assert result["out_scale"] > 1e-3 and result["grad_scale"] > 1e-4  # non-vacuous
        # Measured 3.4 (output) and 4.2 (fc1 grads) eps x scale: the bound is 16 eps x scale.
        assert result["out_err"] <= 16 * EPS32 * result["out_scale"], result
        assert result["fc1_grad_err"] <= 16 * EPS32 * result["grad_scale"], result
        assert result["fc2_grad_err"] <= 16 * EPS32 * result["fc2_grad_scale"], result
        assert result["all_grads_finite"]
        # Tokens of this rank went to experts on both EP ranks, so the exchange was exercised.
        hits = result["experts_hit_per_rank"]
        assert sum(hits[:4]) > 0 and sum(hits[4:]) > 0, hits


def _pad_policy_invariance() -> dict:
    """The same real tokens padded with self pads and with constant pads (padding_mask passed),
    forward + backward of the MoE GPTModel at EP=2; and constant pads without the mask (a leak)."""
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from tests.data.test_batch import _batch, _run_policies

    torch.manual_seed(0)
    model = build_tiny_gpt(tiny_moe_config(), vocab_size=128, max_seq_len=64)
    rank = torch.distributed.get_rank()
    batches = {p: _batch(p, 64, seed=rank) for p in ("self", "constant")}  # > 50 % pads
    runs = _run_policies(model, batches)
    leak = _run_policies(model, {"constant": batches["constant"]}, use_padding_mask=False)
    a, b, c = runs["self"], runs["constant"], leak["constant"]
    expert = [k for k in a["grads"] if ".experts." in k]
    return {
        "real_tokens": a["real_loss"].numel(),
        "loss_bitwise": torch.equal(a["real_loss"], b["real_loss"]),
        "aux_bitwise": a["aux"] is not None and torch.equal(a["aux"], b["aux"]),
        "aux_positive": bool((a["aux"] > 0).all()),
        "other_grads_bitwise": [
            k
            for k in a["grads"]
            if k not in expert and not torch.equal(a["grads"][k], b["grads"][k])
        ],
        "num_other_grads": len(a["grads"]) - len(expert),
        # Expert weight grads: worst |difference| in units of eps * max|grad| of that tensor.
        "expert_grad_ulps": max(
            float((a["grads"][k] - b["grads"][k]).abs().max() / (EPS32 * b["grads"][k].abs().max()))
            for k in expert
        ),
        "leak_grad_ulps": max(
            float((c["grads"][k] - b["grads"][k]).abs().max() / (EPS32 * b["grads"][k].abs().max()))
            for k in b["grads"]
            if b["grads"][k].abs().max() > 0
        ),
    }


def test_ep2_real_tokens_do_not_depend_on_pad_content() -> None:
    """Self pads vs constant pads at EP=2 (real GPTModel, alltoall, aux loss on).

    Bitwise: the real tokens' loss, the aux loss (pads masked out of it) and every gradient outside
    the experts. The experts' weight gradients are not bitwise: pad rows reach different experts
    under the two policies, so each expert's weight-gradient GEMM sums its real rows among a
    different number of (zero-gradient) pad rows, in a different blocking order. Measured: 0 on
    one rank, 2.2 eps x max|grad| (3.7e-9) on the other; the bound is 16 eps x max|grad|. A leak
    of pads into real tokens (constant pads without padding_mask, so they enter the aux loss)
    moves the gradients by ~1e7 eps x max|grad|, far beyond the bound.
    """
    for r in run_distributed(_pad_policy_invariance, 2, ep=2):
        assert r["real_tokens"] > 10 and r["aux_positive"]  # non-vacuous
        assert r["loss_bitwise"] and r["aux_bitwise"]
        assert r["num_other_grads"] > 5 and r["other_grads_bitwise"] == []
        assert r["expert_grad_ulps"] <= 16.0, r
        assert r["leak_grad_ulps"] > 1000 * 16.0, r  # the bound would catch a leak
