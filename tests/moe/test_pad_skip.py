"""Tier: gloo ranks (EP=2). ``--moe-pad-routing skip`` on Megatron's real MoE GPTModel: pads send no
all-to-all row and reach no expert, real tokens' loss, aux loss and gradients are those of ``dispatch``
mode, the experts' load equals the no-padding baseline exactly, and no device-to-host sync is added.

Bitwise: real tokens' per-token loss, the aux loss, and every gradient outside the experts. Expert
weight gradients are not bitwise: in dispatch mode each expert's weight-gradient GEMM sums its real rows
among (zero-gradient) pad rows, so the blocking order differs; the bound is 16 eps x max|grad| (the
measured worst is printed by the assertion message on failure).
"""

import pytest
import torch

from megatron_ext.testing import run_distributed

EPS32 = torch.finfo(torch.float32).eps


def _build(mode: str, dispatcher: str, align: bool, micro_batches=None, **config_overrides):
    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.moe.pad_routing import PadRouting
    from megatron_ext.testing import build_tiny_gpt, tiny_moe_config
    from megatron_ext.testing.tiny_model import local_layer_spec
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    config = tiny_moe_config(moe_token_dispatcher_type=dispatcher, **config_overrides)
    pad_routing = PadRouting(mode, micro_batches=micro_batches)
    spec = with_aligned_moe(
        local_layer_spec(config),
        MoEAlignmentConfig(moe_dispatch_align=align),
        padded_router=False,
        pad_routing=pad_routing,
    )
    torch.manual_seed(0)
    model = build_tiny_gpt(config, vocab_size=128, max_seq_len=64, layer_spec=spec)
    if align:  # fp8 rehearsal: the dispatcher aligns to 16 while the model computes in fp32
        config.fp8 = "e4m3"
        for layer in model.modules():
            if hasattr(layer, "realign"):
                layer.realign()  # the multiple is decided at construction: pass fp8's down
    return model, pad_routing


def _run(model, pad_routing, batch: dict) -> dict:
    """Forward + backward; loss of real tokens, grads, aux loss, rows sent and rows per expert."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_ext.data.batch import gpt_forward_kwargs, masked_mean_loss

    moes = [layer.mlp for layer in model.decoder.layers]
    expert_rows: list[torch.Tensor] = []  # host tokens_per_expert of each layer; read after the run
    hooks = [
        moe.experts.register_forward_pre_hook(lambda m, args: expert_rows.append(args[1].clone()))
        for moe in moes
    ]
    from megatron.core import parallel_state

    from megatron_ext.moe.pad_routing import count_router_tokens

    mask = batch["padding_mask"]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pad_routing.set_micro_batch(
        *count_router_tokens(
            mask,
            tuple(mask.shape),
            tp_size=tp,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=model.config.sequence_parallel,
        )
    )
    model.zero_grad(set_to_none=True)
    get_moe_metrics_tracker().clear()
    loss_BS = model(**gpt_forward_kwargs(batch))
    masked_mean_loss(loss_BS, batch["loss_mask"]).backward()
    for hook in hooks:
        hook.remove()
    aux = get_moe_metrics_tracker().metrics.get("load_balancing_loss")
    dispatcher = moes[0].token_dispatcher
    splits = getattr(dispatcher, "input_splits", None)
    return {
        "real_loss": loss_BS.detach()[batch["loss_mask"].bool()].clone(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "aux": None if aux is None else aux.values.clone(),
        "a2a_rows": None if splits is None else torch.as_tensor(splits).clone(),
        "expert_rows": expert_rows,
    }


def _host_counts(run: dict) -> dict:
    """The run's row counts as ints (read outside the sync-counted region)."""
    a2a = run["a2a_rows"]
    return {
        **run,
        "a2a_rows": None if a2a is None else int(a2a.sum()),
        "expert_rows": [[int(n) for n in rows] for rows in run["expert_rows"]],
    }


def _unpadded(batch: dict, b: int) -> dict:
    """Pack ``b`` of ``batch`` cut to its real tokens: the no-padding baseline (same documents)."""
    n = int((~batch["padding_mask"][b]).sum())
    cut = {k: batch[k][b : b + 1, :n] for k in ("tokens", "labels", "loss_mask", "position_ids")}
    cut["padding_mask"] = torch.zeros(1, n, dtype=torch.bool)
    cut["cu_seqlens"] = batch["cu_seqlens"][b : b + 1].clamp(max=n)
    return cut


def _skip_vs_dispatch(dispatcher: str) -> dict:
    from megatron_ext.testing import count_host_syncs
    from tests.data.test_batch import _batch

    rank = torch.distributed.get_rank()
    batch = _batch("self", 64, seed=rank)  # > 50 % pads
    real = int((~batch["padding_mask"]).sum())
    out: dict = {"real": real, "tokens": batch["padding_mask"].numel()}
    for align in (False, True):
        runs, syncs = {}, {}
        for mode in ("dispatch", "skip"):
            model, pad_routing = _build(mode, dispatcher, align)
            run, syncs[mode] = count_host_syncs(_run, model, pad_routing, batch)
            runs[mode] = _host_counts(run)
        a, b = runs["skip"], runs["dispatch"]
        expert = [k for k in a["grads"] if ".experts." in k]
        out[align] = {
            "loss_bitwise": torch.equal(a["real_loss"], b["real_loss"]),
            "aux_bitwise": torch.equal(a["aux"], b["aux"]),
            "other_grads_not_bitwise": [
                k
                for k in a["grads"]
                if k not in expert and not torch.equal(a["grads"][k], b["grads"][k])
            ],
            "num_other_grads": len(a["grads"]) - len(expert),
            "expert_grad_ulps": max(
                float(
                    (a["grads"][k] - b["grads"][k]).abs().max()
                    / (EPS32 * b["grads"][k].abs().max())
                )
                for k in expert
            ),
            "a2a_rows": (a["a2a_rows"], b["a2a_rows"]),
            "expert_rows": (a["expert_rows"], b["expert_rows"]),
            "syncs": (len(syncs["skip"]), len(syncs["dispatch"])),
            "new_syncs": sorted(set(syncs["skip"]) - set(syncs["dispatch"])),
        }
    # No-padding baseline: each pack cut to its real tokens, run alone; its experts' load per layer.
    model, pad_routing = _build("dispatch", dispatcher, align=False)
    skip_model, skip_routing = _build("skip", dispatcher, align=False)
    loads = {"nopad": None, "skip": None}
    for b in range(batch["tokens"].shape[0]):
        cut = _unpadded(batch, b)
        rows = _host_counts(_run(model, pad_routing, cut))["expert_rows"]
        loads["nopad"] = rows if loads["nopad"] is None else _add(loads["nopad"], rows)
    loads["skip"] = _host_counts(_run(skip_model, skip_routing, batch))["expert_rows"]
    out["loads"] = loads
    return out


def _add(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    return [[x + y for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]


@pytest.fixture(scope="module", params=["alltoall", "allgather"])
def ep2_results(request) -> tuple[str, list[dict]]:
    return request.param, run_distributed(_skip_vs_dispatch, 2, request.param, ep=2)


def test_real_tokens_are_unchanged_by_skipping_pads(ep2_results) -> None:
    _, results = ep2_results
    for r in results:
        assert r["tokens"] - r["real"] > r["real"]  # > 50 % pads: the interesting case
        for align in (False, True):
            x = r[align]
            assert x["loss_bitwise"] and x["aux_bitwise"], x
            assert x["num_other_grads"] > 5 and x["other_grads_not_bitwise"] == [], x
            assert x["expert_grad_ulps"] <= 16.0, x


def test_pads_send_no_row_and_reach_no_expert(ep2_results) -> None:
    dispatcher, results = ep2_results
    topk = 2
    for r in results:
        for align in (False, True):
            (skip_a2a, dispatch_a2a), (skip_rows, dispatch_rows) = (
                r[align]["a2a_rows"],
                r[align]["expert_rows"],
            )
            if dispatcher == "alltoall":
                assert skip_a2a == r["real"] * topk and dispatch_a2a == r["tokens"] * topk
            if not align:  # expert rows without alignment's zero rows: exactly the routed tokens
                assert sum(map(sum, skip_rows)) < sum(map(sum, dispatch_rows))
    # Over both ranks, every real token's K routes reach an expert once per layer; no pad does.
    for layer in range(2):
        got = sum(sum(r[False]["expert_rows"][0][layer]) for r in results)
        assert got == sum(r["real"] for r in results) * topk


def test_skip_load_equals_the_no_padding_baseline_exactly(ep2_results) -> None:
    _, results = ep2_results
    for r in results:
        assert r["loads"]["skip"] == r["loads"]["nopad"], r["loads"]
        assert sum(map(sum, r["loads"]["skip"])) > 0


def test_skip_adds_no_host_sync(ep2_results) -> None:
    _, results = ep2_results
    for r in results:
        for align in (False, True):
            skip, dispatch = r[align]["syncs"]
            assert r[align]["new_syncs"] == [] and skip <= dispatch, r[align]
            assert dispatch > 0  # the detector saw Megatron's own copies (non-vacuous)


def _tp_skip_vs_dispatch() -> dict:
    """TP=2 with sequence parallelism and EP=2 (expert TP 1): each TP rank's routers see half the
    sequence, whose real-token count differs per rank (the second half is mostly pads)."""
    from tests.data.test_batch import _batch

    batch = _batch("self", 64, seed=0)  # the same batch on both TP ranks, as Megatron feeds them
    runs = {
        mode: _host_counts(_run(*_build(mode, "alltoall", False), batch))
        for mode in ("dispatch", "skip")
    }
    a, b = runs["skip"], runs["dispatch"]
    return {
        "loss_bitwise": torch.equal(a["real_loss"], b["real_loss"]),
        "grads_close": all(
            torch.allclose(
                a["grads"][k],
                b["grads"][k],
                rtol=0,
                atol=16 * EPS32 * float(b["grads"][k].abs().max()),
            )
            for k in b["grads"]
        ),
        "expert_rows": [sum(map(sum, a["expert_rows"])), sum(map(sum, b["expert_rows"]))],
        "real": int((~batch["padding_mask"]).sum()),
        "tokens": batch["padding_mask"].numel(),
    }


def test_tp2_sequence_parallel_skip_counts_this_ranks_slice() -> None:
    results = run_distributed(_tp_skip_vs_dispatch, 2, tp=2, ep=2, etp=1, sp=True)
    for r in results:
        assert r["loss_bitwise"] and r["grads_close"], r
        skip_rows, dispatch_rows = r["expert_rows"]
    # Over both ranks every real token's K routes reach an expert once per layer (2 layers), no pad.
    skip_rows = sum(r["expert_rows"][0] for r in results)
    dispatch_rows = sum(r["expert_rows"][1] for r in results)
    assert skip_rows == results[0]["real"] * 2 * 2 and dispatch_rows == results[0]["tokens"] * 2 * 2


def _recompute_skip_vs_dispatch() -> dict:
    """Skip mode under Megatron's MoE activation recompute: the recomputed layers (in backward) find
    their micro-batch's count by the micro-batch context's key of the micro-batch in backward,
    after another micro-batch's forward ran."""
    from megatron_ext.common.micro_batch import MicroBatchContext
    from tests.data.test_batch import _batch

    rank = torch.distributed.get_rank()
    batches = [_batch("self", 64, seed=rank), _batch("self", 64, seed=10 + rank)]
    recompute = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    ref_model, ref_routing = _build("dispatch", "alltoall", False)
    micro_batches = MicroBatchContext()  # begun per micro-batch, as the forward step does
    model, routing = _build("skip", "alltoall", False, micro_batches, **recompute)
    micro_batches.attach(model)
    out = {"recomputed": model.decoder.layers[0].mlp.moe_layer_recompute}
    # Both forwards first, then both backwards (as a pipeline schedule may order them).
    from megatron_ext.data.batch import gpt_forward_kwargs, masked_mean_loss
    from megatron_ext.moe.pad_routing import count_router_tokens

    losses = []
    for index, batch in enumerate(batches):
        mask = batch["padding_mask"]
        micro_batches.begin(index)
        routing.set_micro_batch(*count_router_tokens(mask, tuple(mask.shape)))
        loss_BS = model(**gpt_forward_kwargs(batch))
        losses.append((loss_BS, masked_mean_loss(loss_BS, batch["loss_mask"])))
    for _, loss in reversed(losses):
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_model.zero_grad(set_to_none=True)
    ref_losses = []
    for batch in batches:
        ref_routing.set_micro_batch(batch["padding_mask"].numel(), 0)  # unused in dispatch mode
        loss_BS = ref_model(**gpt_forward_kwargs(batch))
        masked_mean_loss(loss_BS, batch["loss_mask"]).backward()
        ref_losses.append(loss_BS)
    out["loss_bitwise"] = all(
        torch.equal(a.detach()[b["loss_mask"].bool()], r.detach()[b["loss_mask"].bool()])
        for (a, _), r, b in zip(losses, ref_losses, batches, strict=True)
    )
    out["grads_close"] = all(
        torch.allclose(
            g, ref_model.get_parameter(n).grad, rtol=0, atol=16 * EPS32 * float(g.abs().max())
        )
        for n, g in grads.items()
    )
    out["num_grads"] = len(grads)
    return out


def test_skip_under_moe_activation_recompute() -> None:
    for r in run_distributed(_recompute_skip_vs_dispatch, 2, ep=2):
        assert r["recomputed"] and r["num_grads"] > 10, r
        assert r["loss_bitwise"] and r["grads_close"], r
