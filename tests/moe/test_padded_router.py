"""Tier: Megatron on one rank (gloo world of 1, real MoELayer / GPTModel / HybridModel on CPU).

PaddedTopKRouter (aux-loss-free balancing with pads):
- Megatron 0.19.2's TopKRouter raises on the pad mask once expert bias is on; ours adds exactly the
  routing map's non-pad rows to ``local_tokens_per_expert`` (hand count over two micro-batches;
  pads present, and a count with the pads or with the mask in the wrong token order differs),
  routes and combines every token exactly as Megatron's router does, counts nothing without grad,
  and Megatron's ``_update_router_expert_bias`` then moves the bias as the real-token counts say
  (the pads' experts go up, where a count with pads would push them down). No host sync.
- megatron_ext's specs and model provider use it for GPTModel and HybridModel, with and without
  AlignedMoELayer; forward + backward with a padding mask ([B, S] and flattened [1, B*S]) and
  aux_loss + seq_aux_loss + global_aux_loss + z-loss + expert bias runs with exact counts.
- Route replay still binds to it, replays the installed routes, and the pads of the replayed
  routes stay out of the counts.
"""

import functools
import sys

import pytest
import torch

from megatron_ext.testing import run_distributed

E, K, B, S = 8, 2, 2, 24
RATE = 1e-2
ALL_AUX = {
    "moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss", "global_aux_loss"],
    "moe_aux_loss_coeff": [1e-2, 1e-2, 1e-2],
    "moe_z_loss_coeff": 1e-3,
}


def _bias_config(**overrides):
    from megatron_ext.testing import tiny_moe_config

    fields = dict(
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",  # Megatron allows expert bias with sigmoid only
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_bias_update_rate=RATE,
    )
    fields.update(overrides)
    return tiny_moe_config(**fields)


def _pad_masks() -> list[torch.Tensor]:
    """Two micro-batches' ``[B, S]`` masks (True = pad); the rows end in pads of unequal length,
    so reading the mask in the wrong token order (b, s instead of Megatron's s, b) miscounts."""
    pads = []
    for ends in ((10, 20), (18, 6)):
        pad = torch.zeros(B, S, dtype=torch.bool)
        for b, end in enumerate(ends):
            pad[b, end:] = True
        pads.append(pad)
    return pads


def _router_rows(pad_BS: torch.Tensor) -> torch.Tensor:
    """The mask in the router's token order: MoELayer sees [S, B] and flattens it."""
    return pad_BS.t().reshape(-1)


def _update_bias(model, cfg) -> None:
    """What Megatron's ``finalize_model_grads`` does with the counts at the end of a step."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    _update_router_expert_bias([model], cfg, tp_dp_cp_group=group)


def _capture_maps(model) -> tuple[list[torch.Tensor], list]:
    """Forward hooks logging every router call's routing map (and their handles)."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: list[torch.Tensor] = []
    handles = [
        router.register_forward_hook(lambda m, i, o: maps.append(o[1].detach().clone()))
        for router in model.modules()
        if isinstance(router, TopKRouter)
    ]
    return maps, handles


def _layer_checks() -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.moe.layer_specs import with_padded_router
    from megatron_ext.testing import assert_no_host_sync

    cfg = _bias_config()
    torch.manual_seed(0)
    spec = with_padded_router(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False))
    ours = spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False)
    ours.set_layer_number(1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a bias already in play, so it steers the routing compared below
        ours.router.expert_bias.copy_(0.02 * torch.randn(E, generator=gen))
    stock_spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    stock = stock_spec.submodules.mlp(config=_bias_config(), pg_collection=None, is_mtp_layer=False)
    stock.set_layer_number(1)
    stock.load_state_dict(ours.state_dict())
    (ours_maps, _), (stock_maps, _) = _capture_maps(ours), _capture_maps(stock)
    res: dict = {"router": type(ours.router).__name__, "stock_router": type(stock.router).__name__}

    # Pads all share one hidden state aimed at the two experts the real tokens use least: a count
    # that includes pads would call those experts overloaded and push their bias down.
    x_SBH = torch.randn(S, B, cfg.hidden_size, generator=gen)
    pads = _pad_masks()
    with torch.no_grad():  # no grad: Megatron's rule (and ours) counts nothing here
        ours(x_SBH)
    load_E = sum(ours_maps[-1][~_router_rows(p)].sum(0) for p in pads)
    pad_experts = torch.argsort(load_E, stable=True)[:K]
    weight_EH = ours.router.weight.detach()
    h_pad = 200.0 * weight_EH[pad_experts].sum(0)
    res["count_after_no_grad"] = ours.router.local_tokens_per_expert.clone()

    expected = torch.zeros(E, dtype=torch.long)
    naive, wrong_order = expected.clone(), expected.clone()
    res["pads_on_pad_experts"], res["same_routing"], res["same_output"] = [], [], []
    for pad in pads:
        x = x_SBH.clone()
        x[pad.t()] = h_pad
        x.requires_grad_()
        out, _ = ours(x, padding_mask=pad)
        out.sum().backward()
        map_NE, rows = ours_maps[-1], _router_rows(pad)
        expected += map_NE[~rows].sum(0)
        naive += map_NE.sum(0)
        wrong_order += map_NE[~pad.reshape(-1)].sum(0)
        res["pads_on_pad_experts"].append(
            bool((map_NE[rows].nonzero()[:, 1].reshape(-1, K) == pad_experts.sort()[0]).all())
        )
        with torch.no_grad():  # Megatron's router on the same tokens without the mask
            stock_out, _ = stock(x)
        res["same_routing"].append(torch.equal(map_NE, stock_maps[-1]))
        res["same_output"].append(torch.equal(out.detach(), stock_out))
        try:
            stock(x, padding_mask=pad)
            res["stock_error"] = None
        except RuntimeError as e:
            res["stock_error"] = str(e)
    res.update(
        pads=[int(p.sum()) for p in pads],
        counts=ours.router.local_tokens_per_expert.clone(),
        expected=expected,
        naive=naive,
        wrong_order=wrong_order,
        pad_experts=pad_experts,
    )

    counts = ours.router.local_tokens_per_expert.clone()
    with torch.no_grad():
        ours(x, padding_mask=pads[-1])  # evaluation-style forward in train mode
    ours.eval()
    with torch.no_grad():
        ours(x, padding_mask=pads[-1])  # Megatron's evaluate()
    ours.train()
    res["counts_unchanged_by_eval"] = torch.equal(counts, ours.router.local_tokens_per_expert)

    bias_before = ours.router.expert_bias.clone()
    _update_bias(ours, cfg)
    res["bias_before"], res["bias_after"] = bias_before, ours.router.expert_bias.clone()

    ours.router.local_tokens_per_expert.zero_()
    assert_no_host_sync(ours.router._apply_expert_bias, ours_maps[-1], _router_rows(pads[-1]))
    res["host_sync_counts"] = ours.router.local_tokens_per_expert.clone()
    res["host_sync_expected"] = ours_maps[-1][~_router_rows(pads[-1])].sum(0)
    return res


@pytest.fixture(scope="module")
def layer_results() -> dict:
    (res,) = run_distributed(_layer_checks, 1)
    return res


def test_megatrons_router_fails_on_the_pad_mask_with_expert_bias(layer_results):
    r = layer_results
    assert (r["router"], r["stock_router"]) == ("PaddedTopKRouter", "TopKRouter")
    assert r["stock_error"] is not None and "size of tensor" in r["stock_error"]


def test_counts_are_exactly_the_real_tokens(layer_results):
    r = layer_results
    assert r["pads"] == [18, 24] and r["pads_on_pad_experts"] == [True, True]
    assert torch.equal(r["count_after_no_grad"], torch.zeros(E))
    assert r["counts"].dtype == torch.float32 and r["counts"].shape == (E,)
    assert torch.equal(r["counts"], r["expected"].float())
    assert int(r["expected"].sum()) == (2 * B * S - sum(r["pads"])) * K
    # Not vacuous: counting the pads, or reading the mask in b, s order, gives other counts.
    assert not torch.equal(r["naive"], r["expected"])
    assert not torch.equal(r["wrong_order"], r["expected"])
    assert r["counts_unchanged_by_eval"]


def test_routing_and_output_are_megatrons(layer_results):
    assert layer_results["same_routing"] == [True, True]
    assert layer_results["same_output"] == [True, True]


def test_expert_bias_moves_as_the_real_token_counts_say(layer_results):
    r = layer_results
    real, naive = r["expected"].float(), r["naive"].float()
    # Megatron's get_updated_expert_bias: bias + sign(mean - count) * rate (one rank: no reduce).
    want = r["bias_before"] + torch.sign(real.sum() / E - real) * RATE
    assert torch.equal(r["bias_after"], want)
    with_pads = r["bias_before"] + torch.sign(naive.sum() / E - naive) * RATE
    pad_experts = r["pad_experts"]
    # The pads' experts are under-used by real tokens (bias up); with pads they look overloaded.
    assert (r["bias_after"][pad_experts] > r["bias_before"][pad_experts]).all()
    assert (with_pads[pad_experts] < r["bias_before"][pad_experts]).all()


def test_count_update_has_no_host_sync(layer_results):
    r = layer_results
    assert int(r["host_sync_expected"].sum()) > 0
    assert torch.equal(r["host_sync_counts"], r["host_sync_expected"].float())


def _forward_backward(model, tokens, positions, pad) -> dict:
    """One training micro-batch with a pad mask; exact per-router counts against the hand count."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.local_tokens_per_expert.zero_()
    maps, handles = _capture_maps(model)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, None, labels=tokens, padding_mask=pad).float()
    (loss * ~pad).sum().backward()
    for handle in handles:
        handle.remove()
    rows = pad.t().reshape(-1) if pad.shape[0] == B else pad.reshape(-1)  # [B, S] or [1, B*S]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {
        "routers": [type(r).__name__ for r in routers],
        "moe_layers": sorted({type(r).__name__ for r in model.modules() if hasattr(r, "router")}),
        "finite": bool(torch.isfinite(loss).all()),
        "grads": len(grads) > 0 and all(bool(torch.isfinite(g).all()) for g in grads),
        "router_grad": all(
            r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers
        ),
        "counts_exact": [
            torch.equal(r.local_tokens_per_expert, m[~rows].sum(0).float())
            for r, m in zip(routers, maps, strict=True)
        ],
        "counts_total": [int(r.local_tokens_per_expert.sum()) for r in routers],
        "real_tokens": int((~pad).sum()),
    }


def _model_checks() -> dict:
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_ext.moe.layer_specs import (
        get_aligned_gpt_layer_local_spec,
        get_local_hybrid_stack_spec,
    )
    from megatron_ext.moe.load_metrics import ExpertLoadMetrics
    from megatron_ext.testing import build_tiny_gpt
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    pad = _pad_masks()[0]
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (B, S), generator=gen)
    positions = torch.arange(S).expand(B, S)
    aligned = MoEAlignmentConfig(moe_dispatch_align=True, moe_expert_load_metrics=True)
    res: dict = {}

    def hybrid(spec):
        return HybridModel(
            config=_bias_config(num_layers=4, **ALL_AUX),
            hybrid_stack_spec=spec,
            vocab_size=128,
            max_sequence_length=S,
            hybrid_layer_pattern="*E*E",
            position_embedding_type="rope",
        )

    builders = {
        "gpt": lambda: build_tiny_gpt(
            _bias_config(**ALL_AUX),
            max_seq_len=B * S,
            layer_spec=get_aligned_gpt_layer_local_spec(MoEAlignmentConfig(), E),
        ),
        "gpt_aligned": lambda: build_tiny_gpt(
            _bias_config(**ALL_AUX),
            max_seq_len=B * S,
            layer_spec=get_aligned_gpt_layer_local_spec(
                aligned, E, grouped_mm=True, load_metrics=ExpertLoadMetrics(num_experts=E)
            ),
        ),
        "hybrid": lambda: hybrid(get_local_hybrid_stack_spec(E)),
        "hybrid_aligned": lambda: hybrid(
            get_local_hybrid_stack_spec(E, alignment=aligned, grouped_mm=True)
        ),
    }
    for name, build in builders.items():
        destroy_moe_metrics_tracker()  # process-global, sized by the first model's layer count
        torch.manual_seed(0)
        model = build()
        res[name] = _forward_backward(model, tokens, positions, pad)
        bias = [r.expert_bias.clone() for r in model.modules() if hasattr(r, "expert_bias")]
        _update_bias(model, model.config)
        after = [r.expert_bias for r in model.modules() if hasattr(r, "expert_bias")]
        res[name]["bias_moved"] = all(
            not torch.equal(a, b) for a, b in zip(after, bias, strict=True)
        )
        if name == "gpt":  # the flattened [1, B*S] layout (THD-style rows) as well
            flat = _forward_backward(
                model, tokens.reshape(1, -1), torch.arange(B * S)[None], pad.reshape(1, -1)
            )
            res["gpt_flat"] = flat
    return res


def test_gpt_and_hybrid_models_train_with_expert_bias_and_pads():
    (res,) = run_distributed(_model_checks, 1)
    expected_layers = {
        "gpt": (2, ["AlignedMoELayer"]),
        "gpt_flat": (2, ["AlignedMoELayer"]),
        "gpt_aligned": (2, ["AlignedMoELayer"]),
        "hybrid": (2, ["MoELayer"]),
        "hybrid_aligned": (2, ["AlignedMoELayer"]),
    }
    for name, (n_moe, layer_types) in expected_layers.items():
        r = res[name]
        assert r["routers"] == ["PaddedTopKRouter"] * n_moe, (name, r)
        assert r["moe_layers"] == layer_types, (name, r)
        assert r["finite"] and r["grads"] and r["router_grad"], (name, r)
        assert 0 < r["real_tokens"] < B * S  # pads present
        assert r["counts_total"] == [r["real_tokens"] * K] * n_moe, (name, r)
        assert r["counts_exact"] == [True] * n_moe, (name, r)
        if name != "gpt_flat":
            assert r["bias_moved"], name


def _replay_checks() -> dict:
    from megatron_ext.moe.layer_specs import get_aligned_gpt_layer_local_spec
    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.testing import build_tiny_gpt
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = _bias_config(moe_enable_routing_replay=True)
    spec = get_aligned_gpt_layer_local_spec(MoEAlignmentConfig(), E)
    model = build_tiny_gpt(cfg, max_seq_len=S, layer_spec=spec)
    binding = RouteReplayBinding(model, "replay")
    gen = torch.Generator().manual_seed(11)
    routes_BSLK = torch.rand(B, S, 2, E, generator=gen).argsort(-1)[..., :K].to(torch.uint8)
    # The routing maps [L, S*B, E] those routes give (router rows run s * B + b).
    maps_BSLE = torch.zeros(B, S, 2, E, dtype=torch.bool).scatter_(-1, routes_BSLK.long(), True)
    want_LNE = maps_BSLE.permute(2, 1, 0, 3).reshape(2, S * B, E)
    binding.install(routes_BSLK, key=0)
    pad = _pad_masks()[1]
    tokens = torch.randint(0, 128, (B, S), generator=gen)
    r = _forward_backward(model, tokens, torch.arange(S).expand(B, S), pad)
    rows = pad.t().reshape(-1)
    routers = [m.router for m in model.modules() if hasattr(m, "router")]
    r.update(
        bound=[type(router).__name__ for router, _ in binding._restore],
        replays=len(binding.replays),
        counts_from_routes=[
            torch.equal(x.local_tokens_per_expert, want_LNE[i][~rows].sum(0).float())
            for i, x in enumerate(routers)
        ],
        naive_differs=[
            not torch.equal(want_LNE[i][~rows].sum(0), want_LNE[i].sum(0)) for i in range(2)
        ],
    )
    binding.remove()
    return r


def test_route_replay_drives_the_padded_router():
    (r,) = run_distributed(_replay_checks, 1)
    assert r["bound"] == ["PaddedTopKRouter"] * 2 and r["replays"] == 2
    assert r["counts_exact"] == [True, True] and r["counts_from_routes"] == [True, True]
    assert r["naive_differs"] == [True, True]
    assert r["finite"] and r["grads"]


PROVIDER_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", str(S), "--max-position-embeddings", str(S),
    "--position-embedding-type", "rope", "--num-experts", str(E), "--moe-router-topk", str(K),
    "--moe-ffn-hidden-size", "64", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-dtype", "fp32", "--transformer-impl", "local",
    "--micro-batch-size", str(B), "--global-batch-size", str(B), "--train-iters", "2",
    "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--seed", "7", "--use-cpu-initialization",
    # SequentialMLP's biased fc2 fails in place at EP=1, TP=1 on Megatron's own path (not ours).
    "--disable-bias-linear",
]  # fmt: skip
EXPERT_BIAS_ARGS = [
    "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
    "--moe-router-bias-update-rate", "1e-3",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
    "--moe-z-loss-coeff", "1e-3",
]  # fmt: skip


def _provider_checks(argv: list[str]) -> dict:
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.training import run_state
    from megatron_ext.training.arguments import add_megatron_ext_args
    from megatron_ext.training.model_provider import model_provider

    unset_global_variables()
    run_state.reset()
    destroy_moe_metrics_tracker()
    sys.argv = ["pretrain_gpt", *argv]
    parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    model = model_provider()
    if not model.config.moe_router_enable_expert_bias:
        return {
            "routers": [type(m.router).__name__ for m in model.modules() if hasattr(m, "router")]
        }
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 128, (B, S), generator=gen)
    res = _forward_backward(model, tokens, torch.arange(S).expand(B, S), _pad_masks()[0])
    res["model"] = type(model).__name__
    return res


@pytest.mark.parametrize(
    "extra, model, layer",
    [
        (["--moe-pad-routing", "dispatch"], "GPTModel", "MoELayer"),
        (["--moe-dispatch-align", "--moe-expert-load-metrics"], "GPTModel", "AlignedMoELayer"),
        # auto: pads skip dispatch (ours); called without forward_step, pads are routed like text.
        (["--hybrid-layer-pattern", "*E*E", "--num-layers", "4"], "HybridModel", "AlignedMoELayer"),
    ],
)
def test_model_provider_uses_the_padded_router_with_expert_bias(extra, model, layer):
    (r,) = run_distributed(_provider_checks, 1, PROVIDER_ARGS + EXPERT_BIAS_ARGS + extra)
    assert r["model"] == model and r["moe_layers"] == [layer]
    assert r["routers"] == ["PaddedTopKRouter"] * 2
    assert r["finite"] and r["grads"] and r["counts_exact"] == [True, True]
    assert r["counts_total"] == [r["real_tokens"] * K] * 2


@pytest.mark.parametrize(
    "extra",
    [[], ["--moe-expert-load-metrics"], ["--hybrid-layer-pattern", "*E*E", "--num-layers", "4"]],
)
def test_model_provider_keeps_megatrons_router_without_expert_bias(extra):
    (r,) = run_distributed(_provider_checks, 1, PROVIDER_ARGS + extra)
    assert r["routers"] == ["TopKRouter"] * 2  # nothing asked for ours


def _spec_checks() -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import InferenceTopKRouter

    from megatron_ext.moe.layer_specs import (
        get_local_hybrid_stack_spec,
        moe_routers,
        with_aligned_moe,
        with_padded_router,
    )
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    def router_names(spec) -> list[str]:
        return [r.__name__ for r in moe_routers(spec)]

    res: dict = {}
    dense = get_gpt_layer_local_spec()
    res["dense_same_object"] = with_padded_router(dense) is dense
    moe = get_gpt_layer_local_spec(num_experts=E)
    swapped = with_padded_router(moe)
    res["swapped"] = swapped.submodules.mlp.keywords["submodules"].router.__name__
    res["input_untouched"] = moe.submodules.mlp.keywords["submodules"].router.__name__
    res["twice_same"] = with_padded_router(swapped) is swapped
    inference = functools.partial(
        MoELayer,
        submodules=MoESubmodules(
            experts=moe.submodules.mlp.keywords["submodules"].experts, router=InferenceTopKRouter
        ),
    )
    for name, spec in (("no_moe", dense), ("other_router", inference)):
        try:
            with_padded_router(spec, require="--moe-router-enable-expert-bias")
            res[name] = None
        except ValueError as e:
            res[name] = str(e)
    res["other_router_kept"] = (
        with_padded_router(inference).keywords["submodules"].router is InferenceTopKRouter
    )
    alignment = MoEAlignmentConfig(moe_dispatch_align=True)
    res["aligned"] = {
        "default": router_names(with_aligned_moe(moe, alignment)),
        "off": router_names(with_aligned_moe(moe, alignment, padded_router=False)),
    }
    res["hybrid"] = {
        "default": router_names(get_local_hybrid_stack_spec(E)),
        "off": router_names(get_local_hybrid_stack_spec(E, padded_router=False)),
        "aligned_off": router_names(
            get_local_hybrid_stack_spec(E, alignment=alignment, padded_router=False)
        ),
    }
    return res


def test_with_padded_router_swaps_only_megatrons_topk_router():
    (r,) = run_distributed(_spec_checks, 1)
    assert r["dense_same_object"] and r["twice_same"] and r["other_router_kept"]
    assert (r["swapped"], r["input_untouched"]) == ("PaddedTopKRouter", "TopKRouter")
    assert r["no_moe"].startswith("--moe-router-enable-expert-bias: the model spec has no MoE")
    assert "InferenceTopKRouter would count pads" in r["other_router"]
    # Spec functions: ours by default, Megatron's when the provider asks (expert bias off).
    assert r["aligned"] == {"default": ["PaddedTopKRouter"], "off": ["TopKRouter"]}
    assert r["hybrid"] == {
        "default": ["PaddedTopKRouter"],
        "off": ["TopKRouter"],
        "aligned_off": ["TopKRouter"],
    }


def _token_count_worker() -> tuple[float, float, float]:
    """Megatron's and megatron_ext's aux-loss token counts of this rank under a padding mask."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    from megatron_ext.moe.router import local_count_before_the_reduce

    group = parallel_state.get_context_parallel_group()
    real = 1 + 2 * group.rank()  # rank 0 routes 1 real token, rank 1 routes 3 (pads: no row)
    routing_map = torch.zeros(4, E, dtype=torch.bool)
    routing_map[:real, :K] = True
    original = moe_utils.get_tokens_per_expert_and_token_count
    _, megatron_local, _ = original(routing_map, group, topk=K, with_padding_mask=True)
    _, ours, total = local_count_before_the_reduce(original)(routing_map, group, K, True)
    return float(megatron_local), float(ours), float(total)


def test_aux_loss_token_count_is_this_ranks_not_the_groups() -> None:
    """Megatron 0.19.2 reads the local count after the in-place all-reduce over the TP x CP group
    (the group's 4 real tokens on both ranks); the compat row's count is each rank's own, the
    total the group's."""
    results = run_distributed(_token_count_worker, 2, cp=2)
    assert [r[0] for r in results] == [4.0, 4.0]  # what the row exists for
    assert [r[1] for r in results] == [1.0, 3.0] and [r[2] for r in results] == [4.0, 4.0]
