"""Tier: gloo ranks (providers on real parsed arguments) and subprocesses (dry runs of the examples).

The providers in isolation (the real loop runs them in test_real_loop.py); everything it calls from
megatron_ext is exercised here with
arguments parsed and validated by Megatron 0.19.2's own ``parse_and_validate_args``: the model provider
(GPTModel and HybridModel, our MoE layer), the datasets provider (our datasets through Megatron's builder)
and the forward step (pad mask, document masks, replay routes, load metrics), forward and backward.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS, TOPK, EXPERTS = 2, 2, 8

BASE_ARGS = [
    "--num-layers",
    str(NUM_LAYERS),
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "128",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--position-embedding-type",
    "rope",
    "--num-experts",
    str(EXPERTS),
    "--moe-router-topk",
    str(TOPK),
    "--moe-ffn-hidden-size",
    "64",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-router-dtype",
    "fp32",
    "--expert-model-parallel-size",
    "2",
    "--transformer-impl",
    "local",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--lr",
    "1e-3",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "256",
    "--split",
    "100,0,0",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--no-gradient-accumulation-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion",
    "--no-persist-layer-norm",
    "--no-rope-fusion",
    "--seed",
    "7",
    "--use-cpu-initialization",
]


#: Packed data with route replay from the ``_routes`` sidecar next to ``data_prefix``.
REPLAY_ARGS = [
    "--pack-documents", "--pad-to-seq-len",
    "--route-replay-mode", "replay", "--route-data-suffix", "_routes",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    """Corpus documents as a token IndexedDataset plus an aligned route sidecar (random valid routes)."""
    from megatron_ext.training.corpus import corpus_documents
    from tests.data.dataset_helpers import write_documents_with_random_routes

    prefix = str(tmp_path_factory.mktemp("data") / "corpus_text_document")
    docs = [d[:90] for d in corpus_documents()[:80]]
    rng = np.random.default_rng(0)
    return write_documents_with_random_routes(
        prefix, docs, rng, num_layers=NUM_LAYERS, topk=TOPK, num_experts=EXPERTS
    )


def _run_providers(argv: list[str]) -> dict:
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.arguments import add_megatron_ext_args
    from megatron_ext.training import run_state
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

    from megatron_ext.arguments import add_megatron_ext_args
    from megatron_ext.training import run_state
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


EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.sh") if not p.name.startswith("_"))


def _dry_run(script: Path, data_dir: Path) -> subprocess.CompletedProcess:
    """The script's documented command (its header's ``NNODES=N``, else one node) as a dry run:
    the world it validates is the one its parallel sizes are written for."""
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, DATA=str(data_dir))
    env.pop("WORLD_SIZE", None)
    nodes = re.search(r"^# Command: NNODES=(\d+)", script.read_text(), re.MULTILINE)
    env["NNODES"] = nodes.group(1) if nodes else "1"
    return subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )


@pytest.fixture(scope="module")
def example_data(tmp_path_factory, data_prefix) -> Path:
    """DATA for the examples: the files they name exist (the dry run checks route sidecars)."""
    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.replay.route_file import HEADER_EXTENSION
    from megatron_ext.training.corpus import corpus_documents

    data = tmp_path_factory.mktemp("example_data")
    names = [
        "web_text_document",
        "code_text_document",
        "chat_text_document",
        "corpus_text_document",
    ]
    for name in names:
        for ext in (".bin", ".idx"):
            shutil.copy(data_prefix + ext, data / f"{name}{ext}")
    # The RL example's rollouts and routes, written for its model (16 MoE layers, top-6 of 64):
    # the dry run checks the route file's header against the model.
    from tests.data.dataset_helpers import write_documents_with_random_routes

    docs = [d[:90] for d in corpus_documents()[:80]]
    write_documents_with_random_routes(
        str(data / "rollouts_text_document"), docs, np.random.default_rng(1),
        num_layers=16, topk=6, num_experts=64,
    )  # fmt: skip
    assert (data / f"rollouts_text_document_routes{HEADER_EXTENSION}").is_file()
    masks = [np.ones(d[:90].size, dtype=np.uint8) for d in corpus_documents()[:80]]
    write_documents(str(data / "chat_text_document_loss_mask"), masks, np.uint8)
    return data


def test_there_are_three_examples() -> None:
    assert EXAMPLES == [
        "cpu_demo.sh",
        "pretrain_moe_blended.sh",
        "rl_route_replay.sh",
        "sft_fp8_moe_packed.sh",
    ]


BROKEN = [
    ("--pad-policy zeros", "--pad-policy: invalid choice"),
    ("--moe-router-padding-for-quantization", "--moe-router-padding-for-quantization both pad"),
    ("--no-such-flag 3", "unrecognized arguments: --no-such-flag"),
]


@pytest.fixture(scope="module")
def dry_runs(example_data: Path, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every example's dry run and the broken copies', two processes at a time (2 cores; each
    is mostly Megatron's imports)."""
    scripts = {name: ROOT / "examples" / name for name in EXAMPLES}
    original = (ROOT / "examples" / "sft_fp8_moe_packed.sh").read_text()
    assert "  --moe-dispatch-align" in original
    for broken, _ in BROKEN:
        folder = tmp_path_factory.mktemp("broken")
        copy = folder / "sft_copy.sh"
        copy.write_text(
            original.replace("  --moe-dispatch-align", f"  {broken} --moe-dispatch-align")
        )
        shutil.copy(ROOT / "examples" / "_launch.sh", folder / "_launch.sh")
        scripts[broken] = copy
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda item: (item[0], _dry_run(item[1], example_data)), scripts.items())
        return dict(done)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_script_flags_parse_and_validate(name: str, dry_runs) -> None:
    proc = dry_runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron_ext: dry run OK" in proc.stdout
    # HybridModel by default (Megatron 0.19.2 deprecates GPTModel); MODEL=gpt: the Slurm test below.
    assert '"model": "HybridModel"' in proc.stdout
    # --moe-pad-routing auto resolved, and said why: every example is dropless alltoall.
    assert '"moe_pad_routing": "skip (auto: dropless dispatch' in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize(("broken", "message"), BROKEN)
def test_a_wrong_flag_in_a_copy_of_an_example_fails_clearly(
    broken: str, message: str, dry_runs
) -> None:
    proc = dry_runs[broken]
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


def _record_then_replay(argv: list[str], record_prefix: str) -> dict:
    """Record mode through the providers and forward step, write the sidecar, read it back."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.arguments import add_megatron_ext_args
    from megatron_ext.replay.routes import missing_mask
    from megatron_ext.training import run_state
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


def test_context_parallelism_is_refused_at_argument_time(monkeypatch) -> None:
    from megatron.training.arguments import parse_args

    from megatron_ext.arguments import add_megatron_ext_args, configs_from_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *BASE_ARGS, "--context-parallel-size", "2"])
    args = parse_args(extra_args_provider=add_megatron_ext_args)
    with pytest.raises(ValueError, match="--context-parallel-size > 1"):
        configs_from_args(args)


def test_record_mode_needs_one_data_prefix(monkeypatch, tmp_path, data_prefix) -> None:
    from megatron.training.arguments import parse_args

    from megatron_ext.arguments import add_megatron_ext_args, configs_from_args

    argv = [
        *BASE_ARGS,
        "--pack-documents",
        "--route-replay-mode",
        "record",
        "--route-record-path",
        str(tmp_path / "r"),
        "--data-path",
        "0.5",
        data_prefix,
        "0.5",
        data_prefix + "_routes",  # an existing second prefix: the count is what is refused
    ]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *argv])
    with pytest.raises(ValueError, match="exactly one --data-path prefix"):
        configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))


@pytest.mark.parametrize("script", ["cpu_demo.sh", "rl_route_replay.sh"])
def test_an_interpreter_without_megatron_ext_is_refused_in_one_line(script, tmp_path) -> None:
    """The system python3 (or any other) instead of the project's environment: one line naming
    PYTHON, not a traceback from inside Megatron on every rank."""
    isolated = tmp_path / "python"  # this interpreter, blind to the venv's packages and the cwd
    isolated.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    isolated.chmod(0o755)
    env = dict(os.environ, PYTHON=str(isolated), DATA=str(tmp_path), DRY_RUN="1")
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / script)],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: PYTHON={isolated} is not"), lines
    assert "Traceback" not in proc.stderr


def test_examples_take_the_nodes_from_slurm(example_data) -> None:
    """Under sbatch/srun the launcher reads SLURM_NNODES, SLURM_NODEID and the first host of
    SLURM_JOB_NODELIST; the dry run validates for that world size. With MODEL=gpt: the examples'
    GPTModel variant (the same 16 layers as --num-layers) validates too."""
    env = dict(
        os.environ, DRY_RUN="1", PYTHON=sys.executable, DATA=str(example_data),
        SLURM_JOB_NODELIST="gpu[03-05,07],cpu1", SLURM_NNODES="4", SLURM_NODEID="2",
        PATH="/usr/bin:/bin",  # no scontrol: the launcher's own nodelist parsing
        MODEL="gpt",
    )  # fmt: skip
    for key in ("WORLD_SIZE", "NNODES", "NODE_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "pretrain_moe_blended.sh")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch: nnodes=4 node_rank=2 master_addr=gpu03 nproc_per_node=8" in proc.stderr
    assert '"world_size": 32' in proc.stdout
    assert '"model": "GPTModel"' in proc.stdout


def _dry_run_main(argv: list[str], monkeypatch) -> int:
    """``python -m megatron_ext.pretrain_gpt <argv> --dry-run`` in this process (2 ranks' world)."""
    from megatron_ext.pretrain_gpt import main
    from megatron_ext.training import run_state

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *BASE_ARGS, *argv, "--dry-run", "--verbose"])
    try:
        return main()
    finally:
        run_state.reset()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--split", "100,0,0", "--eval-iters", "5", "--eval-interval", "2"], ["--eval-iters 5"]),
        # Megatron's default --eval-iters 100 evaluates after training (and every interval).
        (["--split", "100,0,0", "--eval-interval", "9"], ["--eval-iters 100 (Megatron's default"]),
        (["--split", "99,0,1", "--eval-iters", "1", "--skip-train"], ["--split 99,0,1"]),
        (["--split", "100", "--eval-iters", "0", "--full-validation"], ["--full-validation"]),
    ],
)
def test_evaluation_on_an_empty_validation_split_is_refused_at_argument_time(
    flags, named, data_prefix, monkeypatch, capsys
) -> None:
    assert _dry_run_main(["--data-path", data_prefix, *flags], monkeypatch) == 2
    err = capsys.readouterr().err
    assert "megatron_ext: invalid arguments:" in err
    assert "--split" in err and "--eval-iters 0" in err and "validation data" in err
    for text in named:
        assert text in err


def test_evaluation_without_valid_data_path_is_refused(data_prefix, monkeypatch, capsys) -> None:
    argv = ["--train-data-path", data_prefix, "--eval-iters", "1", "--eval-interval", "2"]
    assert _dry_run_main(argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert "--eval-iters 1" in err and "--train-data-path without --valid-data-path" in err
    assert "set --eval-iters 0" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--split", "99,1,0", "--eval-iters", "1", "--eval-interval", "2"],  # validation weight
        ["--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000"],  # no evaluation
        ["--mock-data", "--eval-iters", "1", "--eval-interval", "5"],  # mock data: an even split
    ],
)
def test_evaluation_with_validation_data_or_none_passes(
    flags, data_prefix, monkeypatch, capsys
) -> None:
    argv = flags if "--mock-data" in flags else ["--data-path", data_prefix, *flags]
    assert _dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err
    assert "megatron_ext: dry run OK" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--split", "99,1,0", "--eval-iters", "0"], "--eval-interval is required when training"),
        (
            ["--split", "99,1,0", "--eval-iters", "0", "--eval-interval", "9"]
            + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 2",
        ),
    ],
)
def test_what_megatron_validates_but_pretrain_fails_on_is_refused_in_the_dry_run(
    flags, named, data_prefix, monkeypatch, capsys
) -> None:
    """Megatron's validate_args passes both; its pretrain failed after startup with a traceback
    on every rank (a TypeError sizing validation samples; the expert grid at world size 2)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's own TP check, on a GPU
    assert _dry_run_main(["--data-path", data_prefix, *flags], monkeypatch) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("flags", "align"),
    [
        ([], 0),  # bf16/fp32: no alignment
        (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], 16),
        (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], 32),
        (["--fp8-format", "e4m3", "--use-transformer-engine-op-fuser"], 256),  # CUTLASS's multiple
        (["--fp8-format", "e4m3", "--moe-dispatch-align-size", "64"], 64),
    ],
)
def test_the_dry_run_reports_the_alignment_the_dispatcher_uses(
    flags, align, data_prefix, monkeypatch, capsys
) -> None:
    from megatron_ext.config import MoEAlignmentConfig
    from megatron_ext.moe.group_aligner import align_size_for_config

    argv = ["--data-path", data_prefix, "--eval-iters", "0", "--eval-interval", "9"]
    argv += ["--moe-dispatch-align", "--bf16", *flags]
    assert _dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f'"expert_group_alignment": {align},' in out, out[-2000:]
    config = argparse.Namespace(fp8=None, fp8_recipe=None, fp4=None, fp4_recipe=None)
    if "--use-transformer-engine-op-fuser" in flags:  # the dispatcher's rule agrees
        config.fp8, config.use_transformer_engine_op_fuser = "e4m3", True
        assert align_size_for_config(config, MoEAlignmentConfig(moe_dispatch_align=True)) == 256


def test_per_split_evaluation_with_valid_data_path_passes(data_prefix, monkeypatch, capsys) -> None:
    argv = ["--train-data-path", data_prefix, "--valid-data-path", data_prefix, "--eval-iters", "1"]
    argv += ["--eval-interval", "5"]
    assert _dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err


def _datasets_or_error(argv: list[str], asks: list[list[int]]) -> list[list[int | None] | str]:
    """Our datasets provider on parsed arguments, once per list of samples asked of the splits:
    each split's length, or the error it raised."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_ext.arguments import add_megatron_ext_args
    from megatron_ext.training import run_state
    from megatron_ext.training.dataset_provider import train_valid_test_datasets_provider

    unset_global_variables()
    run_state.reset()
    sys.argv = ["pretrain_gpt", *argv]
    parse_and_validate_args(extra_args_provider=add_megatron_ext_args)
    results = []
    for sizes in asks:
        try:
            datasets = train_valid_test_datasets_provider(sizes)
        except ValueError as err:
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


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm"),
        (["--sft"], "--sft"),
        (["--fim-data"], "--fim-data"),
        (["--dataloader-fast-cache-load"], "--dataloader-fast-cache-load"),
        (["--rampup-batch-size", "4", "4", "16"], "--rampup-batch-size: Megatron-Core 0.19.2"),
        (
            ["--moe-router-load-balancing-type", "quantile_balancing"],
            "quantile_balancing is not supported",
        ),
        (
            ["--mock-data", "--pack-documents", "--pad-to-seq-len"],
            "--mock-data cannot be combined with --pack-doc",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--route-replay-mode",
                "record",
                "--route-record-path",
                "/tmp/never-written",
                "--pack-documents",
                "--pad-to-seq-len",
                "--data-path",
                "P",
            ],
            "record with --pipeline-model-parallel-size > 1",
        ),
        (
            [
                "--pack-documents",
                "--eval-micro-batch-size",
                "2",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "4",
                "--data-path",
                "P",
            ],
            "--eval-micro-batch-size 1",
        ),
        (["--mtp-num-layers", "1", "--moe-dispatch-align"], "--mtp-num-layers with --moe-disp"),
        (["--train-iters", "0"], "--train-iters must be at least 1, got 0"),
        (
            [
                "--mtp-num-layers",
                "1",
                "--moe-router-enable-expert-bias",
                "--moe-router-score-function",
                "sigmoid",
            ],
            "--mtp-num-layers with --moe-router-enable-expert-bias",
        ),
        (
            [
                "--mtp-num-layers",
                "1",
                "--route-replay-mode",
                "replay",
                "--pack-documents",
                "--pad-to-seq-len",
                "--route-data-suffix",
                "_routes",
                "--data-path",
                "P",
            ],
            "--mtp-num-layers with --route-replay-mode",
        ),
    ],  # fmt: skip
)
def test_what_the_entry_cannot_run_is_refused_at_argument_time(
    monkeypatch, data_prefix, extra: list[str], match: str
) -> None:
    """Megatron accepts each, and each crashed, hung or was silently ignored later in a run."""
    from megatron.training.arguments import parse_args

    from megatron_ext.arguments import add_megatron_ext_args, configs_from_args

    extra = [data_prefix if a == "P" else a for a in extra]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *BASE_ARGS, *extra])
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_args(extra_args_provider=add_megatron_ext_args)
    with pytest.raises(ValueError, match=match):
        configs_from_args(args)


@pytest.mark.parametrize(
    "change, model",
    [
        (["--num-experts", str(2 * EXPERTS)], f"over {2 * EXPERTS} experts"),
        (["--moe-router-topk", "1"], "x top-1 over"),
        (["--num-layers", str(2 * NUM_LAYERS)], f"the model has {2 * NUM_LAYERS} MoE layers"),
    ],
)
def test_a_route_file_for_another_model_is_refused_at_argument_time(
    monkeypatch, data_prefix, change: list[str], model: str
) -> None:
    """The header's L, K, E are checked when arguments are parsed, not at dataset build after
    the model and optimizer exist; the matching model passes."""
    from megatron.training.arguments import parse_args

    from megatron_ext.arguments import add_megatron_ext_args, configs_from_args

    argv = [*BASE_ARGS, *REPLAY_ARGS, "--data-path", data_prefix]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *argv])
    configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))  # the same model
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *argv, *change])
    with pytest.raises(ValueError, match=rf"was written for {NUM_LAYERS} MoE layers .*{model}"):
        configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))


def test_megatrons_own_argument_errors_are_one_line_and_exit_2() -> None:
    """Megatron's validate_args asserts (a global batch its micro-batches cannot divide): the
    entry prints one line naming the problem and exits 2, like its own refusals, not a
    traceback with status 1."""
    argv = [*BASE_ARGS, "--mock-data", "--global-batch-size", "7", "--dry-run"]
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.pretrain_gpt", *argv],
        capture_output=True, text=True, env=env, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "megatron_ext: invalid arguments: " in proc.stderr and "(7)" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
