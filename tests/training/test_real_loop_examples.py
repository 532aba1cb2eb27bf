"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU: the examples under their own torchrun).

Every ``examples/*.sh`` runs for real with ``CPU=1`` (pretrain_moe_blended.sh as the README's command, in
tests/training/test_doc_commands.py) (``examples/_launch.sh``: ``--cpu --transformer-impl
local`` and tiny sizes appended; the parallel sizes that fit 2 ranks in ``OVERRIDES``); the matrix of
model/router/parallel features on the tiny model is tests/training/test_real_loop_features.py. The
examples build a HybridModel (``*E*E`` on CPU) unless ``MODEL=gpt``; GPTModel (deprecated in Megatron
0.19) keeps a real-loop run of what HybridModel runs elsewhere: the fp8 rehearsal here (HybridModel's:
the demo, tests/rehearse/test_demo.py), replay in tests/training/test_checkpoint_resume.py
(HybridModel's: below and the demo).

| launch                     | proves                                                                 |
|----------------------------|------------------------------------------------------------------------|
| sft_fp8_moe_packed, gpt    | GPTModel: fp8 rehearsal (groups aligned to 16), best-fit packing, loss mask |
| rl_route_replay record     | HybridModel at the script's TP 2 + SP: route record -> sidecar of every doc |
| rl_route_replay            | replay of that sidecar reproduces the recording run exactly            |

Each launch: exit 0, 4 iterations of finite, falling ``lm loss`` (fixed seed, constant lr 1e-3), the
model class the loop built (:func:`built_model`; both in tests/training/loop_checks.py), and the effect
of each feature in what the loop logged or wrote. What the CPU loop cannot run yet (the examples' own
``--bf16``) the launcher drops, saying so; given to ``--cpu`` directly, it is refused at argument time.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.testing.real_loop import LoopRun, free_port, launch
from tests.training.loop_checks import (
    EXPERTS,
    ITERATIONS,
    MOE_LAYERS,
    TOPK,
    VERBOSE,
    assert_trains,
    built_model,
    expert_load_lines,
    field_per_iteration,
    without,
)

ROOT = Path(__file__).resolve().parents[2]

#: Every example names a Hugging Face tokenizer directory the test does not have; the data here is
#: byte-level (tools/preprocess_data.py, end-of-document id 256). The HF path is tested on its own
#: (tests/tools/test_hf_tokenizer.py trains a real-loop run with a tokenizer directory).
BYTE_TOKENIZER = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "257")


def run_example(
    name: str,
    data: Path,
    ckpt: Path,
    overrides: list[str],
    model: str = "hybrid",
    variables: dict[str, str] | None = None,
) -> LoopRun:
    """``MODEL=<model> CPU=1 bash examples/<name>`` with ``DATA``/``CKPT`` and ``OVERRIDES`` appended
    last (``--verbose`` among them, for :func:`built_model`). No ``CPU_DROP``: the launcher drops or
    translates what the CPU cannot run (the scripts' --bf16, their base checkpoint, which ``CKPT``
    here does not hold: the tiny model trains from random weights)."""
    env = {
        **os.environ, "CPU": "1", "GPUS_PER_NODE": "2", "PYTHON": sys.executable, "MODEL": model,
        "MASTER_PORT": str(free_port()), "DATA": str(data), "CKPT": str(ckpt),
        "OVERRIDES": " ".join([*BYTE_TOKENIZER, *overrides, VERBOSE]),
        "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **(variables or {}),
    }  # fmt: skip
    for key in ("DRY_RUN", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CPU_DROP"):
        env.pop(key, None)
    argv = ["bash", str(ROOT / "examples" / name)]
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300
    )
    return LoopRun(argv=argv, returncode=proc.returncode, output=proc.stdout)


def run_example_forked(name: str, data: Path, ckpt: Path, overrides: list[str]) -> LoopRun:
    """:func:`run_example`'s ``pretrain_gpt`` flags (read off a stand-in python) on ranks
    :func:`launch` forks from the preloaded server, not under the script's torchrun."""
    env = {
        "GPUS_PER_NODE": "2", "DATA": str(data), "CKPT": str(ckpt),
        "OVERRIDES": " ".join([*BYTE_TOKENIZER, *overrides, VERBOSE]),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        proc = _launch_argv(Path(folder), env, script=name)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    return launch(argv[argv.index("megatron_ext.pretrain_gpt") + 1 :])


def link_prefix(source: str, target: Path) -> None:
    """``target.bin/.idx`` as links to ``source.bin/.idx`` (an example's expected file names)."""
    for ext in (".bin", ".idx"):
        os.symlink(source + ext, str(target) + ext)


# ------------------------------------------------------------------------------------------------
# examples/pretrain_moe_blended.sh
# ------------------------------------------------------------------------------------------------

# Its real-loop run is the README's CPU command, in tests/training/test_doc_commands.py
# (test_the_readmes_cpu_launch_of_the_blended_example_trains): one launch for both.

# ------------------------------------------------------------------------------------------------
# examples/sft_fp8_moe_packed.sh
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    """``chat_text_document`` + ``_loss_mask`` sidecar: the corpus's first sentence of a document as the
    prompt (loss-masked), its second as the response, through tools/preprocess_data.py."""
    data = tmp_path_factory.mktemp("sft")
    jsonl = data / "chat.jsonl"
    with open(ROOT / "megatron_ext/assets/corpus.jsonl") as src, open(jsonl, "w") as out:
        for line in src:
            sentences = re.findall(r"[^.?!]*[.?!]", json.loads(line)["text"])
            if len(sentences) >= 2:
                record = {"prompt": sentences[0].strip() + " ", "response": sentences[1].strip()}
                out.write(json.dumps(record) + "\n")
    subprocess.run(
        [sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input", str(jsonl),
         "--output-prefix", str(data / "chat_text_document"), "--prompt-key", "prompt",
         "--response-key", "response", "--append-eod"],
        check=True, capture_output=True,
    )  # fmt: skip
    return data


def test_sft_example_trains_on_packed_loss_masked_data(sft_data, tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    mask = IndexedDataset(str(sft_data / "chat_text_document_loss_mask"))
    masked = np.concatenate([np.asarray(mask[i]) for i in range(len(mask))])
    assert 0 < masked.mean() < 1  # the sidecar masks prompts and keeps responses
    # MODEL=gpt: GPTModel's real-loop run of the fp8 rehearsal (HybridModel's is the demo's), the
    # long-context launch (LONG=1): its CP 4 shrunk to the 2 processes, EP 2 over the same ranks.
    run = run_example(
        "sft_fp8_moe_packed.sh",
        sft_data,
        tmp_path / "ckpt",
        ["--expert-model-parallel-size", "2", "--eval-iters", "1"],
        model="gpt",
        variables={"LONG": "1"},
    )
    assert_trains(run)
    assert "CPU=1: --context-parallel-size 4 -> 2 (2 processes, TP 1)" in run.output
    assert "data-parallel size: 1, context-parallel size: 2" in run.output
    assert built_model(run) == "GPTModel"
    field_per_iteration(run, "load_balancing_loss")
    expert_load_lines(run)
    # --fp8-format e4m3 --fp8-recipe tensorwise --moe-dispatch-align under --cpu: a rehearsal; every
    # expert group reaching the grouped GEMM was padded to 16 (the backend raises on one that is not).
    assert (
        "megatron_ext: --cpu rehearsal of --fp8-format e4m3 --fp8-recipe tensorwise" in run.output
    )
    groups = re.findall(r"rehearsal: (\d+) expert groups reached the grouped GEMM, (\d+) not a "
                        r"multiple of 16", run.output)  # fmt: skip
    assert len(groups) == 2 and all(int(n) > 0 and int(bad) == 0 for n, bad in groups), groups
    assert "building PackedDataset" in run.output  # --pack-documents
    # --pack-overlong-policy truncate: conversations longer than a pack were cut, and counted.
    truncated = re.search(
        r"over-long documents: \{'num_split': 0, 'num_truncated': (\d+)", run.output
    )
    assert truncated and int(truncated.group(1)) > 0
    assert re.search(r"pack_loss_mask_suffix \.+ _loss_mask", run.output)
    # --load "$CKPT/base" --finetune found nothing to load: trained from scratch, saved at the end.
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


# ------------------------------------------------------------------------------------------------
# examples/rl_route_replay.sh: record routes, then replay them
# ------------------------------------------------------------------------------------------------

#: The RL example on 2 ranks: its own TP 2 + sequence parallelism, EP 4 -> 2 on the same 2 ranks
#: (expert TP 1; both by the launcher under CPU=1); micro-batches of 2 (DP is 1: 4 micro-batches a step, as at TP 1 and DP 2). Its
#: final save in ``torch`` format: ``torch_dist`` refuses the CPU grouped-GEMM experts (megatron_ext's
#: ``GroupedMMLinear``) at EP 2 x TP 2, their sharded tensors carrying no expert-parallel offset.
RL_PARALLEL = ["--micro-batch-size", "2", "--ckpt-format", "torch"]
#: Group-limited routing (4 groups of 2 experts, 1 group per token): a router with these flags can
#: only choose both experts of a token inside one group {2g, 2g+1}.
ONE_GROUP_ROUTING = ["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"]


@pytest.fixture(scope="module")
def rl_record(corpus_prefix, tmp_path_factory) -> tuple[Path, LoopRun]:
    """The RL example in record mode: Megatron's own routes go to ``DATA/rollouts_text_document_routes``,
    the sidecar the replay run reads (``--route-data-suffix _routes``)."""
    data = tmp_path_factory.mktemp("rl")
    link_prefix(corpus_prefix, data / "rollouts_text_document")
    write_policy_sidecars(str(data / "rollouts_text_document"))
    record = ["--route-replay-mode", "record", "--route-record-path",
              str(data / "rollouts_text_document_routes")]  # fmt: skip
    run = run_example(
        "rl_route_replay.sh", data, tmp_path_factory.mktemp("ckpt"), RL_PARALLEL + record
    )
    return data, run


def write_policy_sidecars(prefix: str) -> None:
    """What the script's policy loss reads beside the tokens, as ingest-rollouts writes it: the
    loss mask (a 10-token prompt), advantages (+1: the policy loss then raises every completion
    token's log-prob, so ``lm loss`` falls as in a language-model run) and behaviour log-probs
    (-5, about the random model's), each with its header naming the tokens' digest."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from tests.training.rl_data import write_sidecar

    tokens = IndexedDataset(prefix)  # held: its lengths are a view of its memory-mapped index
    lengths = tokens.sequence_lengths.tolist()
    completion = [np.arange(n) >= 10 for n in lengths]
    for suffix, dtype, value, scope in (("_loss_mask", np.uint8, 1, "mask"),
                                        ("_advantages", np.float32, 1.0, "sequence"),
                                        ("_logprobs", np.float32, -5.0, "completion")):  # fmt: skip
        values = [np.where(c, value, 0).astype(dtype) for c in completion]
        write_sidecar(prefix, suffix, values, dtype, scope, prefix)


def recorded_rows(prefix: Path) -> np.ndarray:
    """Every recorded ``(token, layer)`` top-k row of a route sidecar, missing rows left out."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.replay.routes import missing_mask

    routes = IndexedDataset(str(prefix))
    rows = []
    for i in range(len(routes)):
        routes_TLK = np.asarray(routes[i]).reshape(-1, MOE_LAYERS, TOPK)
        rows.append(routes_TLK[~missing_mask(routes_TLK)])
    return np.concatenate(rows)


def test_route_record_writes_a_sidecar_for_every_document(corpus_prefix, rl_record) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data, run = rl_record
    assert_trains(run)
    assert built_model(run) == "HybridModel"
    assert re.search(r"sequence_parallel \.+ True", run.output)
    assert re.search(r"tensor_model_parallel_size \.+ 2", run.output)
    tokens = IndexedDataset(corpus_prefix)
    prefix = data / "rollouts_text_document_routes"
    assert f"megatron_ext: wrote recorded routes of {len(tokens)} documents" in run.output
    meta = json.loads(Path(str(prefix) + ".routes.json").read_text())
    assert (meta["num_documents"], meta["num_layers"], meta["topk"], meta["num_experts"]) == (
        len(tokens), MOE_LAYERS, TOPK, EXPERTS,
    )  # fmt: skip
    assert meta["moe_layer_ids"] == [1, 3]  # the E positions of the CPU pattern "*E*E", 0-based
    routes = IndexedDataset(str(prefix))
    np.testing.assert_array_equal(
        routes.sequence_lengths, tokens.sequence_lengths * MOE_LAYERS * TOPK
    )
    rows = recorded_rows(prefix)
    # 4 iterations x 8 packs x 128 positions bound the real tokens trained on (pads are not recorded);
    # the packs are mostly real tokens (documents are split to fill them).
    positions = ITERATIONS * 8 * 128 * MOE_LAYERS
    assert positions // 2 < rows.shape[0] <= positions
    assert rows.max() < EXPERTS and (rows[:, 0] != rows[:, 1]).all()


def test_rl_example_replays_the_recorded_routes(rl_record, tmp_path) -> None:
    data, record = rl_record
    record_losses = assert_trains(record)
    # The interesting case: most recorded routes pair experts of two different groups, which the
    # replaying run's router (ONE_GROUP_ROUTING) can never choose by itself.
    rows = recorded_rows(data / "rollouts_text_document_routes")
    assert (rows[:, 0] // 2 != rows[:, 1] // 2).mean() > 0.5
    run = run_example(
        "rl_route_replay.sh", data, tmp_path / "ckpt", RL_PARALLEL + ONE_GROUP_ROUTING
    )
    assert_trains(run)
    assert built_model(run) == "HybridModel"
    assert "building RoutedPackedDataset" in run.output  # --route-replay-mode replay
    assert re.search(r"moe_router_group_topk \.+ 1\n", run.output)
    # Same weights, data and packs as the recording run: with the recorded routes replayed, every real
    # token meets the same experts, so loss, aux loss and gradient norm repeat the recording run's
    # exactly (pads are loss-masked, out of the aux loss, and attend only among themselves). Without
    # replay, group-limited routing would have changed most of those routes.
    for key in ("lm loss", "load_balancing_loss", "grad norm"):
        assert [run.iterations[i][key] for i in sorted(run.iterations)] == [
            record.iterations[i][key] for i in sorted(record.iterations)
        ], key
    assert run.losses == record_losses
    expert_load_lines(run)
    # The script's RL step: the policy loss on the advantages and log-probs beside the tokens.
    # (Its negative ``policy loss`` is not on Megatron's console line, which prints only
    # non-negative averages: megatron/training/training.py training_log, ``if avg >= 0.0``.)
    for fields in run.iterations.values():
        assert fields["rl/logprob_mismatch"] > 0 and fields["rl/ratio_mean"] > 0, fields


@pytest.mark.parametrize(
    "recompute",
    [
        ["--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"],
        ["--recompute-granularity", "selective", "--recompute-modules", "moe", "layernorm"],
    ],
    ids=["full", "selective"],
)  # fmt: skip
def test_replay_under_activation_recompute_repeats_the_recording_run(
    rl_record, tmp_path, recompute
) -> None:
    """The RL example's replay with Megatron's activation recompute (whole layers, or the MoE layers
    and norms): each recomputed router replays the micro-batch's routes again, so loss, aux loss
    and gradient norm still repeat the recording run's exactly (the router alone would pick other
    experts: ONE_GROUP_ROUTING). The script's command, its ranks forked from the preloaded server
    (the record and replay runs above take the script's own torchrun)."""
    data, record = rl_record
    run = run_example_forked(
        "rl_route_replay.sh", data, tmp_path / "ckpt", RL_PARALLEL + ONE_GROUP_ROUTING + recompute
    )
    assert run.preloaded, run.not_forked_because
    assert_trains(run)
    assert re.search(r"recompute_granularity \.+ " + recompute[1], run.output)
    # Full recompute repeats the recording run exactly. Selective MoE recompute under the
    # example's --calculate-per-token-loss repeats it to the 6th digit: with the aux loss scaled
    # by this rank's own valid-token count (the launch row that reads it before Megatron's
    # in-place all-reduce, found by the CP tests), the last printed digit of the loss moved
    # after step 1 (6.100421 vs 6.100422). Not yet explained: a known gap (docs/replay.md).
    exact = recompute[1] == "full"
    for key in ("lm loss", "load_balancing_loss", "grad norm"):
        got = [run.iterations[i][key] for i in sorted(run.iterations)]
        want = [record.iterations[i][key] for i in sorted(record.iterations)]
        assert got == (want if exact else pytest.approx(want, rel=2e-6)), key


# ------------------------------------------------------------------------------------------------
# What the CPU loop cannot run yet
# ------------------------------------------------------------------------------------------------


def test_what_the_cpu_cannot_run_is_dropped_or_translated_one_line_each(sft_data, tmp_path) -> None:
    """``CPU=1`` with no ``CPU_DROP``: the SFT example's --bf16, Transformer Engine, EP 8 and its
    base checkpoint (absent under ``CKPT``) are each dropped or translated with one line saying so,
    and the launch validates (a dry run of the script, no launch). The same --bf16 given to
    ``--cpu`` directly (in ``OVERRIDES``, which the launcher passes as given) is refused at
    argument time, naming the flag."""
    env = {
        **os.environ, "CPU": "1", "GPUS_PER_NODE": "2", "PYTHON": sys.executable,
        "DATA": str(sft_data), "CKPT": str(tmp_path / "ckpt"), "DRY_RUN": "1",
        "OVERRIDES": " ".join(BYTE_TOKENIZER),
    }  # fmt: skip
    env.pop("CPU_DROP", None)
    script = str(ROOT / "examples" / "sft_fp8_moe_packed.sh")
    refused_env = {**env, "CPU_DROP": "", "OVERRIDES": " ".join([*BYTE_TOKENIZER, "--bf16"])}
    with ThreadPoolExecutor(max_workers=1) as beside:  # the two dry runs, one per core
        refused = beside.submit(
            subprocess.run, ["bash", script], capture_output=True, text=True, timeout=300,
            env=refused_env,
        )  # fmt: skip
        proc = subprocess.run(
            ["bash", script], capture_output=True, text=True, env=env, timeout=300
        )
        refused = refused.result()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "megatron_ext: dry run OK" in proc.stdout
    notes = [line for line in proc.stderr.splitlines() if line.startswith("CPU=1: ")]
    assert notes == [
        "CPU=1: --transformer-impl transformer_engine -> local (Megatron's own modules)",
        "CPU=1: --bf16 dropped (the CPU loop trains in fp32)",
        "CPU=1: --expert-model-parallel-size 8 -> 2 (2 processes)",
        f"CPU=1: --pretrained-checkpoint {tmp_path}/ckpt/base dropped: it holds no checkpoint, so "
        "the tiny CPU model starts from random weights (a base checkpoint of the full-size model "
        "would not load into it; put one of the CPU model there to fine-tune it)",
    ], proc.stderr[-2000:]
    proc = refused
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "invalid arguments: --cpu cannot run --bf16" in proc.stderr, proc.stderr[-2000:]


def _launch_argv(
    tmp_path: Path, env: dict[str, str], *args: str, script: str = "sft_fp8_moe_packed.sh"
) -> subprocess.CompletedProcess:
    """What ``CPU=1 bash examples/SCRIPT *args`` would run, printed by a stand-in python."""
    fake = tmp_path / "python"
    # "-c": the launcher's environment check, answered "yes"; anything else is printed.
    fake.write_text('#!/usr/bin/env bash\n[ "$1" = -c ] && exit 0\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    (tmp_path / "EEEE").touch()  # a file "*E*E" would glob to
    full_env = {**os.environ, "CPU": "1", "PYTHON": str(fake), **env}
    for key in ("MODEL", "DRY_RUN", "CPU_DROP", "GPUS_PER_NODE", "OVERRIDES"):
        if key not in env:
            full_env.pop(key, None)  # the script's default
    return subprocess.run(
        ["bash", str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, env=full_env, cwd=tmp_path,
    )  # fmt: skip


def values_of(argv: list[str], flag: str) -> list[str]:
    """Every value ``flag`` is given in ``argv``, in order (Megatron takes the last)."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_cpu_overrides_reach_the_command_line(tmp_path) -> None:
    """``CPU=1``: the script's flags, then ``--cpu --transformer-impl local``, the tiny model's layers
    and CPU_SIZES, then OVERRIDES; CPU_DROP leaves flags out with their values; patterns are not
    glob-expanded."""
    proc = _launch_argv(
        tmp_path,
        {"CPU_DROP": "--bf16 --fp8-format --fp8-recipe", "OVERRIDES": "--lr 5e-4"},
        "--seed", "3",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert argv[:2] == ["-m", "megatron_ext.launcher"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    for dropped in ("--bf16", "--fp8-format", "--fp8-recipe", "tensorwise", "e4m3"):
        assert dropped not in argv
    assert "--moe-dispatch-align" in argv  # the flag after a dropped value is kept
    cpu = argv.index("--cpu")
    assert argv[cpu + 1 : cpu + 5] == [
        "--transformer-impl",
        "local",
        "--hybrid-layer-pattern",
        "*E*E",
    ]
    assert argv.index("--seed") < cpu
    lrs = values_of(argv, "--lr")
    assert lrs == ["1e-5", "1e-3", "5e-4"]  # script, CPU_SIZES, OVERRIDES: Megatron takes the last


def test_model_switch_gives_the_same_layers_to_either_class(tmp_path) -> None:
    """MODEL unset: HybridModel, the script's 16 transformer layers as 16 x ``*E`` (attention, MoE),
    CPU=1's 2 as ``*E*E``; MODEL=gpt: GPTModel, ``--num-layers`` 16 then 2, no pattern."""
    hybrid = _launch_argv(tmp_path, {}).stdout.splitlines()
    assert values_of(hybrid, "--hybrid-layer-pattern") == ["*E" * 16, "*E*E"]
    assert "--num-layers" not in hybrid  # derived from the pattern by Megatron
    gpt = _launch_argv(tmp_path, {"MODEL": "gpt"}).stdout.splitlines()
    assert values_of(gpt, "--num-layers") == ["16", "2"]
    assert "--hybrid-layer-pattern" not in gpt
    # Everything else is the same command.
    assert without(gpt, "--num-layers") == without(hybrid, "--hybrid-layer-pattern")
    wrong = _launch_argv(tmp_path, {"MODEL": "llama"})
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert "MODEL=llama: expected hybrid (HybridModel) or gpt (GPTModel)" in wrong.stderr
