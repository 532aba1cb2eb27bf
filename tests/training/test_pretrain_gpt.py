"""Tier: gloo ranks (providers on real parsed arguments).

The providers in isolation (the real loop runs them in test_real_loop_examples.py and
test_real_loop_features.py): everything they call from megatron_ext, with arguments parsed and
validated by Megatron 0.19.2's own ``parse_and_validate_args``: the model provider (GPTModel and
HybridModel, our MoE layer), the datasets provider (our datasets through Megatron's builder; a
validation split rounded to no documents) and the forward step (pad mask, document masks, replay
routes, load metrics), forward and backward; record mode writes a route sidecar aligned with the
tokens.

Elsewhere: the examples' dry runs (test_example_dry_runs.py); what the entry refuses at argument time
(test_config.py, test_eval_args.py, test_entry_dry_run.py).
"""

import subprocess
import sys

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.testing import run_distributed
from tests.training.entry_args import BASE_ARGS, EXPERTS, NUM_LAYERS, REPLAY_ARGS, TOPK


def _run_providers(argv: list[str]) -> dict:
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.training import run_state
    from megatron_ext.training.arguments import add_megatron_ext_args
    from megatron_ext.training.dataset_provider import train_valid_test_datasets_provider
    from megatron_ext.training.forward_step import forward_step
    from megatron_ext.training.model_provider import model_provider

    unset_global_variables()
    run_state.reset()
    sys.argv = ["pretrain_gpt", *argv]
    args = parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    model = model_provider()
    train, _, _ = train_valid_test_datasets_provider([8, 0, 0])
    loader = torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size)
    routing = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda m, i, o: routing.append(o[1].detach()))
    batch = next(iter(loader))
    output, loss_fn = forward_step(iter([batch]), model)
    loss, num_tokens, report = loss_fn(output)
    loss.backward()
    moe_layers = [type(m).__name__ for m in model.modules() if "MoELayer" in type(m).__name__]
    result = {
        "model": type(model).__name__,
        "dataset": type(train.datasets[0] if hasattr(train, "datasets") else train).__name__,
        "moe_layers": moe_layers,
        "loss": float(loss),
        "num_tokens": int(num_tokens),
        "grad_norm": float(
            sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None)
        ),
        "batch_keys": sorted(batch),
    }
    if "routes" in batch:
        # Replay: every MoE layer's routing map equals the routes of this rank's tokens.
        expected_LTE = _routing_maps_of(batch["routes"])
        result["replay_match"] = [
            bool(torch.equal(routing[layer], expected_LTE[layer])) for layer in range(NUM_LAYERS)
        ]
    return result


def _routing_maps_of(routes_BSLK: torch.Tensor) -> torch.Tensor:
    """The ``[L, S*B, E]`` routing maps routes ``[B, S, L, K]`` should produce (router order is s, b)."""
    routes = routes_BSLK.long()
    maps_BSLE = torch.zeros(*routes.shape[:3], EXPERTS, dtype=torch.bool).scatter_(-1, routes, True)
    return maps_BSLE.permute(2, 1, 0, 3).reshape(routes.shape[2], -1, EXPERTS)


def test_gpt_providers_and_forward_step_with_self_padded_gpt_dataset(data_prefix) -> None:
    argv = BASE_ARGS + ["--data-path", data_prefix]
    for result in run_distributed(_run_providers, 2, argv, ep=2):
        assert result["model"] == "GPTModel" and result["dataset"] == "SelfPaddedGPTDataset"
        # Nothing asked for alignment or metrics, but --moe-pad-routing auto skips pads (dropless).
        assert result["moe_layers"] == ["AlignedMoELayer"] * NUM_LAYERS
        assert np.isfinite(result["loss"]) and result["num_tokens"] > 0 and result["grad_norm"] > 0
        assert "padding_mask" in result["batch_keys"]
        assert "cu_seqlens" not in result["batch_keys"]  # Megatron's default: no document mask
    # Megatron's --dataloader-inter-document-masking reaches the self-padded GPTDataset (it was
    # dropped, and Megatron's validate_args then turned the dataloader's attention mask off too,
    # so attention crossed documents): samples carry their document boundaries.
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    if "inter_document_masking" not in GPTDatasetConfig.__dataclass_fields__:
        return  # megatron-core 0.18.2 has no such flag
    masked = argv + ["--dataloader-inter-document-masking"]
    for result in run_distributed(_run_providers, 2, masked, ep=2):
        assert result["dataset"] == "SelfPaddedGPTDataset" and "cu_seqlens" in result["batch_keys"]
        assert np.isfinite(result["loss"]) and result["grad_norm"] > 0


def test_aligned_moe_packed_data(data_prefix) -> None:
    argv = BASE_ARGS + [
        "--data-path",
        data_prefix,
        "--pack-documents",
        "--pad-to-seq-len",
        "--moe-dispatch-align",
    ]
    for result in run_distributed(_run_providers, 2, argv, ep=2):
        assert result["dataset"] == "PackedDataset"
        assert result["moe_layers"] == ["AlignedMoELayer"] * NUM_LAYERS
        assert {"cu_seqlens", "padding_mask"} <= set(result["batch_keys"])
        assert np.isfinite(result["loss"]) and result["grad_norm"] > 0


def _steps_with_eval(argv: list[str]) -> dict:
    """Two training steps of two micro-batches with an evaluation forward in between, replay and
    load metrics on: every forward replays its own routes and the metrics count step 0 exactly."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.training import run_state
    from megatron_ext.training.arguments import add_megatron_ext_args
    from megatron_ext.training.dataset_provider import train_valid_test_datasets_provider
    from megatron_ext.training.forward_step import forward_step
    from megatron_ext.training.model_provider import model_provider

    unset_global_variables()
    run_state.reset()
    sys.argv = ["pretrain_gpt", *argv]
    args = parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    model = model_provider()
    train, _, _ = train_valid_test_datasets_provider([16, 0, 0])
    rank = torch.distributed.get_rank()
    chosen = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda m, i, o: chosen.append(o[1].detach()))

    def run(indices: list[int], train_mode: bool) -> tuple[bool, int]:
        batch = torch.utils.data.default_collate([train[i] for i in indices])
        chosen.clear()
        with torch.set_grad_enabled(train_mode):
            output, loss_fn = forward_step(iter([batch]), model)
            if train_mode:
                loss_fn(output)[0].backward()
        expected_LTE = _routing_maps_of(batch["routes"])
        return all(torch.equal(c, e) for c, e in zip(chosen, expected_LTE, strict=True)), int(
            (~batch["padding_mask"]).sum()
        )

    matches, real_tokens = [], 0
    args.curr_iteration = 0
    for mb in range(2):
        ok, real = run([rank * 4 + 2 * mb, rank * 4 + 2 * mb + 1], True)
        matches.append(ok)
        real_tokens += real
    matches.append(run([8 + rank, 10 + rank], False)[0])  # evaluation between steps
    args.curr_iteration = 1
    matches.append(run([12 + rank, 14 + rank], True)[0])  # starts step 1: logs step 0
    real = torch.tensor([real_tokens])
    torch.distributed.all_reduce(real)
    summary = run_state.state(args).last_load_summary
    return {
        "micro_batches_per_step": get_num_microbatches(),
        "replay_matches": matches,
        "real_tokens_step0": int(real),
        "tokens": [sum(summary[f"layer{n}/tokens"]) for n in (1, 2)],
        "real": [sum(summary[f"layer{n}/real_tokens"]) for n in (1, 2)],
        "has_max_vio": "layer1/rank_max_vio" in summary and "layer1/real_rank_max_vio" in summary,
    }


@pytest.mark.parametrize("pad_routing", ["dispatch", "skip"])
def test_keys_metrics_and_replay_across_micro_batches_and_evaluation(
    data_prefix, pad_routing
) -> None:
    argv = BASE_ARGS + [
        "--data-path",
        data_prefix,
        *REPLAY_ARGS,
        "--moe-expert-load-metrics",
        "--log-interval",
        "1",
        "--moe-pad-routing",
        pad_routing,
    ]
    argv[argv.index("--global-batch-size") + 1] = "8"
    for r in run_distributed(_steps_with_eval, 2, argv, ep=2):
        assert r["micro_batches_per_step"] == 2
        assert r["replay_matches"] == [True] * 4  # both micro-batches, the evaluation, step 1
        # Step 0 only (not the evaluation, not step 1): 2 ranks x 2 micro-batches x 2 rows x 64 tokens,
        # each routed to top-2 experts; real tokens exclude the pads.
        # In skip mode pads reach no expert: the tokens counted with pads are the real ones.
        routed = 2 * 2 * 2 * 64 if pad_routing == "dispatch" else r["real_tokens_step0"]
        assert r["tokens"] == [routed * TOPK] * NUM_LAYERS
        assert r["real"] == [r["real_tokens_step0"] * TOPK] * NUM_LAYERS
        assert 0 < r["real_tokens_step0"] < 2 * 2 * 2 * 64  # the packs do have pads
        assert r["has_max_vio"]


def test_route_replay_from_sidecar_reaches_every_moe_layer(data_prefix) -> None:
    argv = BASE_ARGS + [
        "--data-path",
        data_prefix,
        *REPLAY_ARGS,
    ]
    for result in run_distributed(_run_providers, 2, argv, ep=2):
        assert result["dataset"] == "RoutedPackedDataset"
        assert result["replay_match"] == [True] * NUM_LAYERS
        assert np.isfinite(result["loss"]) and result["grad_norm"] > 0


def test_hybrid_model_is_chosen_by_layer_pattern(data_prefix) -> None:
    argv = [a for a in BASE_ARGS] + [
        "--data-path",
        data_prefix,
        "--hybrid-layer-pattern",
        "*E*E",
        "--moe-dispatch-align",
    ]
    argv[argv.index("--num-layers") + 1] = "4"
    for result in run_distributed(_run_providers, 2, argv, ep=2):
        assert result["model"] == "HybridModel"
        assert result["moe_layers"] == ["AlignedMoELayer"] * 2
        assert np.isfinite(result["loss"]) and result["grad_norm"] > 0


def _record_then_replay(argv: list[str], record_prefix: str) -> dict:
    """Record mode through the providers and forward step, write the sidecar, read it back."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.replay.routes import missing_mask
    from megatron_ext.training import run_state
    from megatron_ext.training.arguments import add_megatron_ext_args
    from megatron_ext.training.dataset_provider import train_valid_test_datasets_provider
    from megatron_ext.training.forward_step import forward_step
    from megatron_ext.training.model_provider import model_provider

    unset_global_variables()
    run_state.reset()
    sys.argv = [
        "pretrain_gpt",
        *argv,
        "--route-replay-mode",
        "record",
        "--route-record-path",
        record_prefix,
    ]
    args = parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    model = model_provider()
    train, _, _ = train_valid_test_datasets_provider([8, 0, 0])
    rank = torch.distributed.get_rank()
    samples = [train[i] for i in range(rank * 2, rank * 2 + 2)]  # distinct packs per DP rank
    batch = torch.utils.data.default_collate(samples)
    chosen = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda m, i, o: chosen.append(o[1].detach()))
    forward_step(iter([batch]), model)
    written = run_state.finish_recording(args)
    torch.distributed.barrier()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    routes = np.fromfile(record_prefix + ".bin", dtype=np.uint8)
    written_docs = IndexedDataset(record_prefix)
    # What the routers chose for this rank's tokens: top-k sets [L, S, B, K] (sorted expert ids).
    real = ~batch["padding_mask"]
    seq = batch["tokens"].shape[1]
    picked = torch.stack(chosen).reshape(NUM_LAYERS, seq, len(samples), EXPERTS)
    topk_LSBK = picked.nonzero()[:, -1].reshape(NUM_LAYERS, seq, len(samples), TOPK)
    matches = []
    for b, pack in enumerate(batch["pack_index"].tolist()):
        doc_Q, start_Q, len_Q = train.pack_pieces(pack)
        from_file = np.concatenate(
            [
                written_docs[int(d)].reshape(-1, NUM_LAYERS, TOPK)[int(s0) : int(s0) + int(n)]
                for d, s0, n in zip(doc_Q, start_Q, len_Q, strict=True)
            ]
        )  # [real tokens of the pack, L, K], in pack order
        n_real = int(real[b].sum())
        chosen_real = topk_LSBK[:, :n_real, b].permute(1, 0, 2).numpy()
        matches.append(bool(np.array_equal(np.sort(from_file, -1), chosen_real)))
    return {
        "file_matches_router_choice": matches,
        "written": written,
        "file_bytes": int(routes.size),
        "recorded_real_tokens": int(real.sum()),
        "missing_fraction": float(missing_mask(routes.reshape(-1, NUM_LAYERS, TOPK)).mean()),
        "pack_index": batch["pack_index"].tolist(),
    }


def test_record_mode_writes_a_route_sidecar_aligned_with_the_tokens(data_prefix, tmp_path) -> None:
    argv = BASE_ARGS + ["--data-path", data_prefix, "--pack-documents", "--pad-to-seq-len"]
    record = str(tmp_path / "recorded_routes")
    results = run_distributed(_record_then_replay, 2, argv, record, ep=2)
    assert results[0]["written"] == 80 and results[1]["written"] is None  # rank 0 writes, once
    # One K-byte row per token per MoE layer, aligned with every token of the token dataset.
    token_count = sum(
        min(90, d.size)
        for d in __import__(
            "megatron_ext.training.corpus", fromlist=["corpus_documents"]
        ).corpus_documents()[:80]
    )
    assert results[0]["file_bytes"] == token_count * NUM_LAYERS * TOPK
    recorded = sum(r["recorded_real_tokens"] for r in results)
    assert 0 < recorded < token_count  # 4 packs recorded, the other documents stay missing
    assert results[0]["missing_fraction"] == pytest.approx(1 - recorded / token_count)
    assert sorted(results[0]["pack_index"] + results[1]["pack_index"]) == [0, 1, 2, 3]
    # The file holds exactly what each rank's routers chose for every real token of its packs.
    assert all(m for r in results for m in r["file_matches_router_choice"])
    assert all(len(r["file_matches_router_choice"]) == 2 for r in results)


def _datasets_or_error(argv: list[str], asks: list[list[int]]) -> list[list[int | None] | str]:
    """Our datasets provider on parsed arguments, once per list of samples asked of the splits:
    each split's length, or the error it raised."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.training import run_state
    from megatron_ext.training.arguments import add_megatron_ext_args
    from megatron_ext.training.dataset_provider import (
        DataRefusedError,
        train_valid_test_datasets_provider,
    )

    unset_global_variables()
    run_state.reset()
    sys.argv = ["pretrain_gpt", *argv]
    parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    results = []
    for sizes in asks:
        try:
            datasets = train_valid_test_datasets_provider(sizes)
        except DataRefusedError as err:  # printed in one line by the entry, exit 2
            results.append(str(err))
        else:
            results.append([None if d is None else len(d) for d in datasets])
    return results


@pytest.mark.timeout(180)  # Megatron's GPTDataset would loop forever on the empty split
@pytest.mark.parametrize(
    "packing", [[], ["--pack-documents", "--pad-to-seq-len"]], ids=["gpt", "packed"]
)
def test_a_validation_split_rounded_to_no_documents(packing, data_prefix) -> None:
    # 80 documents, --split 995,5,0: the validation share is round(79.6)..round(80), nothing. The
    # argument check passes it (the weight is not 0); the datasets provider refuses what Megatron's
    # loop asks of it under --eval-iters > 0 and, under --eval-iters 0, returns None for it (so
    # Megatron builds no loader; an empty dataset would fail its sampler).
    argv = [*BASE_ARGS, "--data-path", data_prefix, *packing]
    argv[argv.index("--split") + 1] = "995,5,0"
    # One rank: the refusal is raised where rank 0 builds, before Megatron's builder barrier.
    argv[argv.index("--expert-model-parallel-size") + 1] = "1"
    ((asked, unasked),) = run_distributed(_datasets_or_error, 1, argv, [[8, 4, 0], [8, 0, 0]])
    assert isinstance(asked, str), asked
    assert "--split 995,5,0: the valid split gets no documents" in asked
    assert "4 samples are asked of it" in asked and "set --eval-iters 0" in asked
    assert unasked[0] >= 8 and unasked[1] is None, unasked


@pytest.mark.timeout(180)
def test_full_validation_of_a_validation_split_rounded_to_no_documents(data_prefix) -> None:
    # --full-validation asks no count of the split (Megatron passes None: all of it), so it
    # builds empty; Megatron's loop would then fail on len(None) building the iterators.
    argv = [*BASE_ARGS, "--data-path", data_prefix, "--full-validation"]
    argv[argv.index("--split") + 1] = "995,5,0"
    argv[argv.index("--expert-model-parallel-size") + 1] = "1"
    ((err,),) = run_distributed(_datasets_or_error, 1, argv, [[8, None, None]])
    assert isinstance(err, str), err
    assert err.startswith("--full-validation evaluates on the whole validation split")
    assert f"--split 995,5,0 gives it no sample of --data-path {data_prefix}" in err


def test_process_groups_are_destroyed_before_interpreter_exit(tmp_path) -> None:
    """``main`` ends by destroying every process group (gloo work left to interpreter exit can
    abort the process after training finished). In a fresh interpreter: the default group and a
    subgroup, as Megatron makes, are gone afterwards, and a second call is a no-op."""
    code = f"""
import torch.distributed as dist
from megatron_ext.pretrain_gpt import destroy_process_groups
dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
sub = dist.new_group([0])
dist.all_reduce(__import__("torch").ones(1), group=sub)
destroy_process_groups()
assert not dist.is_initialized()
destroy_process_groups()
print("destroyed")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "destroyed" in proc.stdout, proc.stderr[-2000:]
