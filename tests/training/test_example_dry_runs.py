"""Tier: subprocesses (the example scripts under ``DRY_RUN=1``, no GPU).

Every script in examples/ parses and validates its documented command (Megatron's flags and ours)
for the world size it is written for, and so does the examples' GPTModel variant under Slurm's
environment; a wrong flag in a copy of an example, or an interpreter without megatron_ext, fails
in one clear line.
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.compat.te_site.sitecustomize import MARKER
from tests.dry_run_server import DryRunServer
from tests.training.doc_blocks import header_commands, launch_env
from tests.training.entry_args import ROOT

ROPE = "megatron.core.models.common.embeddings.rope_utils"
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.sh") if not p.name.startswith("_"))


def te_standin_env() -> dict[str, str]:
    """The environment under which Megatron's modules hold Transformer Engine's attributes as on
    a GPU node (tests/compat/te_site): the dry run meets the startup check a GPU launch meets."""
    from megatron_ext.compat.table import TABLE
    from tests.compat.te_site.sitecustomize import ENV, te_bound_attributes

    site = str(ROOT / "tests" / "compat" / "te_site")
    path = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    wanted = te_bound_attributes(sorted({row.module for row in TABLE}))
    return {"PYTHONPATH": path, ENV: json.dumps(wanted)}


#: The key of the RL example's GPTModel dry run with the ingested loss mask (docs/replay.md's
#: train command) among the dry runs, and what it adds to the documented command.
RL_GPT = "rl_route_replay.sh, MODEL=gpt, --pack-loss-mask-suffix _loss_mask"
RL_GPT_ARGS = {"MODEL": "gpt"}, ["--pack-loss-mask-suffix", "_loss_mask"]


def documented_launches(script: Path) -> list[dict[str, str]]:
    """The variables of each ``# Command: VAR=... bash examples/X.sh`` of the script's header."""
    launches = [launch_env(c) for c in header_commands(script)]
    documented = [variables for variables, _ in filter(None, launches)]
    assert documented, f"{script}: no '# Command: ... bash examples/...' in its header"
    return documented


def _dry_run_env() -> dict[str, str]:
    """What every dry run here runs under, before its script's documented variables."""
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, **te_standin_env())
    for key in ("WORLD_SIZE", "NNODES", "NODE_RANK", "MASTER_ADDR", "CPU"):
        env.pop(key, None)
    return env


def run_time_variables() -> tuple[str, ...]:
    """What the dry runs' environments differ in from :func:`_dry_run_env`: the variables of the
    documented commands (``NNODES=8 ... bash examples/X.sh``; read by the scripts, or by the entry
    after its imports), those the launcher sets (``WORLD_SIZE``, ``RANK``, ...), ``DATA``, the
    test's ``MODEL=gpt``, and ``PYTHON``, the forking server's executable (read by bash only)."""
    documented = {
        name
        for script in EXAMPLES
        for variables in documented_launches(ROOT / "examples" / script)
        for name in variables
    }
    launcher = {"WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS"}
    return tuple(sorted(documented | launcher | {"DATA", "PYTHON", *RL_GPT_ARGS[0]}))


@pytest.fixture(scope="module")
def dry_run_server(tmp_path_factory):
    """The server the dry runs' ``python -m megatron_ext.pretrain_gpt ... --dry-run`` is forked
    from (tests/dry_run_server.py): Megatron imported once under the stand-ins'
    environment, not once per dry run (about 5 s of CPU each). It imports while the data is made."""
    folder = tmp_path_factory.mktemp("dry_run_server")
    server = DryRunServer(folder, _dry_run_env(), run_time_variables())
    yield server
    server.close()


def _dry_run(
    script: Path,
    data_dir: Path,
    extra: tuple[dict, list] = ({}, []),
    which: int = 0,
    python: Path | str = sys.executable,
) -> subprocess.CompletedProcess:
    """The script's documented command (its header's ``# Command:`` number ``which``, with its
    variables) as a dry run: the world it validates is the one its parallel sizes are written
    for, with Transformer Engine's attributes bound as on the GPU node it is written for
    (:func:`te_standin_env`). These are the header launches of tests/training/test_doc_commands.py,
    which runs the other documented commands. ``python``: the interpreter (``PYTHON``), or the
    dry-run server's executable standing in for it."""
    env = dict(_dry_run_env(), PYTHON=str(python))
    env.update(documented_launches(script)[which])
    env.update(extra[0])
    env["DATA"] = str(data_dir)
    return subprocess.run(
        ["bash", str(script), *extra[1]], capture_output=True, text=True, env=env, timeout=300,
        cwd=ROOT,
    )  # fmt: skip


#: The examples' other documented launches (their headers' later ``# Command:`` lines): the SFT
#: example's long-context one with context parallelism on 64 GPUs and Megatron's --sft path on 8;
#: the RL example on 16 and 64.
VARIANTS = {
    "sft_fp8_moe_packed.sh, LONG=1 (CP 4, 64 GPUs)": ("sft_fp8_moe_packed.sh", 1),
    "sft_fp8_moe_packed.sh, SFT=1 (8 GPUs)": ("sft_fp8_moe_packed.sh", 2),
    "rl_route_replay.sh, 16 GPUs": ("rl_route_replay.sh", 1),
    "rl_route_replay.sh, 64 GPUs": ("rl_route_replay.sh", 2),
}


@pytest.fixture(scope="module")
def example_data(tmp_path_factory, data_prefix, sft_data) -> Path:
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
    # The SFT example's SFT=1 launch: a real tokenizer for Megatron's SFTTokenizer (its prompt
    # format's special tokens in the vocabulary) and a JSONL of conversations.
    os.symlink(sft_data[0], data / "tokenizer")
    os.symlink(sft_data[1], data / "chat.jsonl")
    # The RL example's rollouts, ingested as docs/replay.md shows: a vLLM 0.34 dump of a model
    # whose Hugging Face config has 16 decoder layers, all MoE, top-6 of 64 (the route header
    # records decoder layers 0-15; the HybridModel's MoE layers are 1, 3, ..., 31, its GPTModel
    # variant's 0-15: both map them in order). The dry run checks the header against the model.
    from megatron_ext.replay.route_file import read_header
    from tests.tools.engine_encoders import vllm034_response, vllm034_rows
    from tests.tools.test_ingest_rollouts import load_tool as load_ingest

    rng = np.random.default_rng(1)
    with open(data / "rollouts.jsonl", "w") as dump:
        for doc in corpus_documents()[:80]:
            ids = [int(t) for t in doc[:90]]
            buffer = np.argsort(rng.random((len(ids), 16, 64)), axis=-1)[..., :6]
            rows = vllm034_rows(buffer.astype(np.int32), 10, num_experts=64, prompt_start=0)
            response = vllm034_response("chat", ids[:10], [ids[10:]], [rows])
            # What the policy loss reads: the engine's log-probs (a chat's logprobs.content) and an
            # advantage the RL framework adds to each choice.
            choice = response["choices"][0]
            choice["logprobs"] = {"content": [{"logprob": -1.5} for _ in ids[10:]]}
            choice["advantage"] = 1.0
            dump.write(json.dumps(response) + "\n")
    config = {"num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 6}
    (data / "config.json").write_text(json.dumps(config))
    assert load_ingest().main([
        "--format", "vllm", "--input", str(data / "rollouts.jsonl"), "--no-progress",
        "--model-config", str(data / "config.json"),
        "--output-prefix", str(data / "rollouts_text_document"),
        "--token-keys", "logprobs", "--sequence-keys", "advantages=advantage",
    ]) == 0  # fmt: skip
    header = read_header(str(data / f"rollouts_text_document_routes{HEADER_EXTENSION}"))
    assert header["moe_layer_ids"] == list(range(16))  # the source's numbering, not the model's
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


#: Wrong flags in copies of an example (a copy each: one dry run each). A bad choice of one of our
#: flags is argparse's own message, shown by the parser in process (tests/training/test_launch_log.py).
BROKEN = [
    ("--moe-router-padding-for-quantization", "--moe-router-padding-for-quantization both pad"),
    ("--no-such-flag 3", "unrecognized arguments: --no-such-flag"),
]


#: The example also dry-run by a fresh interpreter (key ``"<name>, fresh"``), to compare.
FRESH = "pretrain_moe_blended.sh"
#: The key of :func:`_slurm_dry_run`'s result among the dry runs.
SLURM = "pretrain_moe_blended.sh under Slurm, MODEL=gpt"


def _slurm_dry_run(example_data: Path) -> subprocess.CompletedProcess:
    """pretrain_moe_blended.sh's dry run as the third of four Slurm nodes, with MODEL=gpt."""
    env = dict(
        os.environ, DRY_RUN="1", PYTHON=sys.executable, DATA=str(example_data),
        SLURM_JOB_NODELIST="gpu[03-05,07],cpu1", SLURM_NNODES="4", SLURM_NODEID="2",
        PATH="/usr/bin:/bin",  # no scontrol: the launcher's own nodelist parsing
        MODEL="gpt",
    )  # fmt: skip
    for key in ("WORLD_SIZE", "NNODES", "NODE_RANK", "MASTER_ADDR"):
        env.pop(key, None)
    return subprocess.run(
        ["bash", str(ROOT / "examples" / "pretrain_moe_blended.sh")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dry_runs(
    dry_run_server: DryRunServer, example_data: Path, tmp_path_factory
) -> dict[str, subprocess.CompletedProcess]:
    """Every example's dry run, the broken copies' and the Slurm one, two at a time (2 cores),
    forked from :func:`dry_run_server` where a fork is what a fresh interpreter would run."""
    python = dry_run_server.wait_ready().python
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
        slurm = pool.submit(_slurm_dry_run, example_data)
        rl_gpt = pool.submit(
            _dry_run, scripts["rl_route_replay.sh"], example_data, RL_GPT_ARGS, 0, python
        )
        variants = {
            key: pool.submit(_dry_run, scripts[script], example_data, ({}, []), which, python)
            for key, (script, which) in VARIANTS.items()
        }
        fresh = pool.submit(_dry_run, scripts[FRESH], example_data)
        done = dict(
            pool.map(
                lambda item: (item[0], _dry_run(item[1], example_data, python=python)),
                scripts.items(),
            )
        )
        more = {key: future.result() for key, future in variants.items()}
        more[f"{FRESH}, fresh"] = fresh.result()
        return {**done, **more, SLURM: slurm.result(), RL_GPT: rl_gpt.result()}


#: The examples that fine-tune a base checkpoint (``--pretrained-checkpoint $CKPT/...``; Megatron
#: stops without one), and where their default ``CKPT`` puts it: absent here.
FINE_TUNED = {
    "rl_route_replay.sh": "/checkpoints/moe_rl/policy",
    "sft_fp8_moe_packed.sh": "/checkpoints/moe_sft/base",
}


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - set(FINE_TUNED)))
def test_example_script_flags_parse_and_validate(name: str, dry_runs) -> None:
    proc = dry_runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron_ext: dry run OK" in proc.stdout
    # It ran as on a GPU node with Transformer Engine: Megatron's fused RoPE kernel was bound, and
    # the startup check passed (before, every such launch was refused with exit 2).
    assert f"{MARKER} {ROPE}: fused_apply_rotary_pos_emb" in proc.stderr, proc.stderr[-3000:]
    # HybridModel by default (Megatron 0.19.2 deprecates GPTModel); MODEL=gpt: the Slurm test below.
    assert '"model": "HybridModel"' in proc.stdout
    # --moe-pad-routing auto resolved, and said why: every example is dropless alltoall.
    assert '"moe_pad_routing": "skip (auto: dropless dispatch' in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("name", sorted(FINE_TUNED))
def test_fine_tuning_examples_without_their_base_checkpoint_are_refused_in_one_line(
    name: str, dry_runs
) -> None:
    """Every flag parses and validates (the checkpoint is checked last, after Megatron's model
    config); the missing base checkpoint, on which Megatron's launch stops after building the
    model, is the one error."""
    proc = dry_runs[name]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{MARKER} {ROPE}: fused_apply_rotary_pos_emb" in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "invalid arguments" in line]
    assert errors == [
        f"megatron_ext: invalid arguments: --pretrained-checkpoint {FINE_TUNED[name]} holds no "
        f"checkpoint (no latest_checkpointed_iteration.txt; nor does --load "
        f"{FINE_TUNED[name].rsplit('/', 1)[0]}): Megatron would stop with 'No checkpoint found'; "
        "name a directory Megatron saved"
    ], proc.stderr[-3000:]


def test_the_sft_examples_long_context_and_megatron_sft_launches_validate(dry_runs) -> None:
    """The SFT example at 8, 16 and 64 GPUs: its long-context launch (CP 4, 32k packs, every
    conversation padded to a multiple of 8) and Megatron's --sft path validate every flag; the one
    error is the missing base checkpoint, checked last."""
    expected = {  # Megatron's own line for the world it initialised
        "sft_fp8_moe_packed.sh": "world size: 16, data-parallel size: 16, context-parallel size: 1",
        "sft_fp8_moe_packed.sh, LONG=1 (CP 4, 64 GPUs)": (
            "world size: 64, data-parallel size: 16, context-parallel size: 4"
        ),
        "sft_fp8_moe_packed.sh, SFT=1 (8 GPUs)": (
            "world size: 8, data-parallel size: 8, context-parallel size: 1"
        ),
    }
    for name, needle in expected.items():
        proc = dry_runs[name]
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if "invalid arguments" in line]
        assert len(errors) == 1 and "--pretrained-checkpoint" in errors[0], proc.stderr[-3000:]
        assert needle in proc.stdout + proc.stderr, (name, proc.stdout[-3000:])


def test_the_rl_example_validates_at_16_and_64_gpus(dry_runs) -> None:
    """Its 2- and 8-node launches: every flag and file validated for the world Megatron
    initialised; the one error is the missing policy checkpoint, checked last."""
    for name, world, data in (("16 GPUs", 16, 8), ("64 GPUs", 64, 32)):
        proc = dry_runs[f"rl_route_replay.sh, {name}"]
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if "invalid arguments" in line]
        assert len(errors) == 1 and "--pretrained-checkpoint" in errors[0], proc.stderr[-3000:]
        assert f"world size: {world}, data-parallel size: {data}," in proc.stdout + proc.stderr


def test_the_rl_example_replays_ingested_routes_on_either_model_class(dry_runs) -> None:
    """Routes ingested with a Hugging Face config (decoder layers 0-15) pass the launch's checks
    for the HybridModel (MoE layers 1, 3, ..., 31) and, with the ingested loss mask, for the
    GPTModel variant (0-15): the one error left is the missing base checkpoint, checked last."""
    for name in ("rl_route_replay.sh", RL_GPT):
        proc = dry_runs[name]
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if "invalid arguments" in line]
        assert len(errors) == 1 and "--pretrained-checkpoint" in errors[0], proc.stderr[-3000:]
        assert "route file" not in proc.stderr
    assert "--pack-loss-mask-suffix _loss_mask" in " ".join(dry_runs[RL_GPT].args)


@pytest.mark.parametrize(("broken", "message"), BROKEN)
def test_a_wrong_flag_in_a_copy_of_an_example_fails_clearly(
    broken: str, message: str, dry_runs
) -> None:
    proc = dry_runs[broken]
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


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


def test_examples_take_the_nodes_from_slurm(dry_runs) -> None:
    """Under sbatch/srun the launcher reads SLURM_NNODES, SLURM_NODEID and the first host of
    SLURM_JOB_NODELIST; the dry run validates for that world size. With MODEL=gpt: the examples'
    GPTModel variant (the same 16 layers as --num-layers) validates too."""
    proc = dry_runs[SLURM]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launch: nnodes=4 node_rank=2 master_addr=gpu03 nproc_per_node=8" in proc.stderr
    assert '"world_size": 32' in proc.stdout
    assert '"model": "GPTModel"' in proc.stdout


def test_the_dry_runs_are_forked_where_a_fork_runs_what_a_fresh_interpreter_would(
    dry_runs, dry_run_server
) -> None:
    """Every dry run above but three ran forked from the server: cpu_demo.sh's (``--cpu`` prepares
    the process before Megatron's import), the Slurm one (its own environment, no stand-ins) and
    the fresh one compared below ran as fresh interpreters. A forked dry run prints what the fresh
    interpreter prints, byte for byte, and exits with its status."""
    records = dry_run_server.records()
    assert len(records) == len(dry_runs) - 2  # the Slurm and fresh runs name the interpreter
    fresh = [record["why"] for record in records if not record["forked"]]
    assert fresh == ["--cpu: the entry does more before Megatron's import"], fresh
    forked, fresh_run = dry_runs[FRESH], dry_runs[f"{FRESH}, fresh"]
    assert forked.returncode == fresh_run.returncode == 0
    assert MARKER in forked.stderr  # what the server's imports printed, where they would be
    assert (forked.stdout, forked.stderr) == (fresh_run.stdout, fresh_run.stderr)
