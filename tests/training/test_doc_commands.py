"""Tier: subprocesses (the documented commands, as written; GPU launches as dry runs, CPU ones for real).

Every ``bash`` block of README.md and docs/*.md, and the data commands of the examples' headers, runs
in one working directory, in the order the documents give them (the README's data first, as it says),
each distinct command once. A block that launches on GPUs (``torchrun``, or ``bash examples/...``
without ``CPU=1``) runs with ``DRY_RUN=1``: every flag validated for the launch's world size, no GPU;
those dry runs (forked from one server that imported Megatron: tests/dry_run_server.py) and the
headers' data commands go in their own order beside the other blocks.
Its ``MEGATRON_ARGS`` (the reader's own flags) are a small MoE model's, and ``DATA`` holds the files
the blocks name. The header launches themselves are dry-run by tests/training/test_example_dry_runs.py.
"""

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.testing.real_loop import LoopRun, free_port
from tests.dry_run_server import DryRunServer
from tests.training.doc_blocks import DOCS, EXAMPLES, bash_blocks, header_commands, normalized
from tests.training.entry_args import ROOT
from tests.training.loop_checks import (
    EXPERTS as TINY_EXPERTS,
)
from tests.training.loop_checks import (
    ITERATIONS,
    assert_trains,
    expert_load_lines,
    field_per_iteration,
)

#: The reader's own launch flags in the feature blocks: a 2-layer MoE GPTModel (attention + MoE in
#: each layer, the decoder layers a Hugging Face config.json counts, which convert-routes reads),
#: 8 experts, top-2, EP 8 over the blocks' 8 GPUs, bf16 and Transformer Engine as on a GPU cluster.
MEGATRON_ARGS = """MEGATRON_ARGS=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 128
  --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 --num-experts 8
  --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-token-dispatcher-type alltoall
  --expert-model-parallel-size 8 --bf16 --transformer-impl transformer_engine
  --tokenizer-type NullTokenizer --vocab-size 257 --micro-batch-size 1 --global-batch-size 8
  --train-iters 10 --lr 1e-4 --eval-interval 10 --eval-iters 1)
"""
LAYERS, TOPK, EXPERTS = 2, 2, 8

#: The README's setup line that puts megatron-ext and python3 on PATH.
ACTIVATE = "source .venv/bin/activate"
#: A login shell's PATH before any environment is activated.
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What `make setup` reads, and the environment it keeps, as a checkout has them.
CHECKOUT = ("Makefile", "requirements", "pyproject.toml", "setup.py", "megatron_ext", ".venv")

#: ``torchrun`` as the blocks call it; under ``DRY_RUN=1`` the dry run of the same launch on rank 0
#: of the world it names, as examples/_launch.sh does.
TORCHRUN = """#!/usr/bin/env bash
[ "${DRY_RUN:-0}" = 1 ] || exec python3 -m torch.distributed.run "$@"
nproc=1 nnodes=1
while [ "$1" != -m ]; do
  case "$1" in --nproc-per-node) nproc=$2; shift ;; --nnodes) nnodes=$2; shift ;; esac; shift
done
WORLD_SIZE=$((nproc * nnodes)) RANK=0 exec python3 "$@" --dry-run
"""

#: ``sbatch --nodes N ... --wrap CMD`` as Slurm runs it on the first node: CMD with Slurm's variables.
SBATCH = """#!/usr/bin/env bash
while [ $# -gt 0 ]; do
  case "$1" in --nodes) nodes=$2; shift ;; --wrap) wrap=$2; shift ;; esac; shift
done
SLURM_NNODES=$nodes SLURM_NODEID=0 SLURM_JOB_NODELIST="gpu[01-0$nodes]" exec bash -c "$wrap"
"""


def commands(block: str) -> list[str]:
    """A block's commands: lines joined across backslash continuations (and a heredoc kept whole)."""
    found, current = [], ""
    for line in block.splitlines():
        current += line + "\n"
        heredoc = re.search(r"<<-?'?(\w+)'?", current)
        if line.endswith("\\") or (
            heredoc and not current.rstrip().endswith("\n" + heredoc.group(1))
        ):
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            found.append(current)
        current = ""
    return found


def documented_commands() -> list[tuple[str, str]]:
    """(where, block) in running order: each block with the commands not seen before."""
    found = [(path.name, block) for path in DOCS for block in bash_blocks(path)]
    for script in EXAMPLES:
        found += [
            (f"{script.name} header", command + "\n")
            for command in header_commands(script)
            if not re.match(r"([A-Z_]+=\S* )*bash ", command)  # launches: the dry-run tests
        ]
    # `pip install`: tests/test_wheel.py installs the wheel in a fresh venv (never this one).
    found = [
        (w, "".join(c for c in commands(b) if not c.startswith("pip install"))) for w, b in found
    ]
    seen, unique = set(), []
    for where, block in found:
        new = [c for c in commands(block) if normalized(c) not in seen]
        seen.update(normalized(c) for c in new)
        if new:
            unique.append((where, "".join(new)))
    return unique


def is_gpu_launch(block: str) -> bool:
    return "torchrun" in block or "sbatch" in block or ("bash examples/" in block and "CPU=1" not in block
                                    and "cpu_demo.sh" not in block)  # fmt: skip


def _write_tiny_model_data(data: Path, work: Path) -> None:
    """The files the feature blocks name: token files, a loss-mask sidecar, and a vLLM 0.34 dump of
    the rollouts (``rollouts.jsonl``) with the model's ``config.json`` for ``convert-routes``."""
    import json

    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.training.corpus import corpus_documents
    from tests.tools.engine_encoders import vllm034_response, vllm034_rows

    # Byte ids below 256: the examples name a tokenizer directory the dry run reads no vocabulary
    # from, so the ids must fit the model's 256 embedding rows there.
    docs = [d[:90] for d in corpus_documents()[:80]]
    for name in ("chat", "web", "code", "rollouts"):
        write_documents(str(data / f"{name}_text_document"), docs)
    masks = [(np.arange(d.size) >= 10).astype(np.uint8) for d in docs]  # a 10-token prompt
    write_documents(str(data / "chat_text_document_loss_mask"), masks, np.uint8)
    rng = np.random.default_rng(0)
    with open(work / "rollouts.jsonl", "w") as out:
        for doc in docs:
            ids = [int(t) for t in doc]
            buffer = np.stack([rng.permutation(EXPERTS)[:TOPK] for _ in range(len(ids) * LAYERS)])
            buffer = buffer.reshape(len(ids), LAYERS, TOPK).astype(np.int32)
            rows = vllm034_rows(buffer, num_prompt=10, num_experts=EXPERTS, prompt_start=0)
            response = vllm034_response("chat", ids[:10], [ids[10:]], [rows])
            out.write(json.dumps(response) + "\n")
    config = {"num_hidden_layers": LAYERS, "num_experts": EXPERTS, "num_experts_per_tok": TOPK}
    (work / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def doc_work(tmp_path_factory) -> Path:
    """The working directory the documented commands run in (``out/`` is theirs)."""
    return tmp_path_factory.mktemp("docs")


#: What the GPU launches' environments differ in from the one their dry-run server started under:
#: what the blocks export (``DATA``), what the torchrun and Slurm stand-ins and the examples'
#: launcher set; each read after the imports, if at all.
DRY_RUN_TIME = ("DATA", "WORLD_SIZE", "RANK", "CUDA_DEVICE_MAX_CONNECTIONS", "SLURM_NNODES",
                "SLURM_NODEID", "SLURM_JOB_NODELIST")  # fmt: skip


@pytest.fixture(scope="module")
def doc_dry_runs() -> dict:
    """The GPU launches' dry-run server, once ``doc_runs`` has started it."""
    started: dict = {}
    yield started
    if "server" in started:
        started["server"].close()


@pytest.fixture(scope="module")
def doc_runs(
    doc_work: Path, doc_dry_runs: dict, tmp_path_factory
) -> list[tuple[str, str, subprocess.CompletedProcess]]:
    work = doc_work
    for name in ("examples", "tools"):
        os.symlink(ROOT / name, work / name)
    bin_dir, data = work / ".bin", work / "gpu_data"
    bin_dir.mkdir()
    data.mkdir()
    header_data = work / "header_data"
    header_data.mkdir()
    _write_tiny_model_data(data, work)
    # The sft example header's conversations (prompt / response).
    (work / "sft.jsonl").write_text('{"prompt": "a question ", "response": "an answer"}\n' * 20)
    # The cluster's commands only: megatron-ext and python3 come from the README's own setup lines
    # (make setup; source .venv/bin/activate), run here as written in a copy of the checkout's
    # layout, on a clean PATH.
    shims = {"torchrun": TORCHRUN, "sbatch": SBATCH, "srun": '#!/bin/sh\nexec "$@"\n'}
    for name, text in shims.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for name in CHECKOUT:
        os.symlink(ROOT / name, work / name)
    env = {
        **os.environ, "PATH": CLEAN_PATH,
        "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port()),  # the launchers' documented knob (others may hold 6000)
        "MEGATRON_LOGGING_LEVEL": "20",  # Megatron's INFO lines (model layout, blend) are read below
    }  # fmt: skip
    for key in (
        "VIRTUAL_ENV",
        "PYTHON",
        "DRY_RUN",
        "CPU",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "TORCHDYNAMO_DISABLE",
        "DATA",
    ):
        env.pop(key, None)

    def run(number: int, where: str, block: str) -> subprocess.CompletedProcess:
        block_env = dict(env, PATH=f"{bin_dir}:{env['PATH']}")
        preamble = "set -euo pipefail\n"
        if is_gpu_launch(block):
            block_env = server.wait_ready().env  # python3 forked from the server: see below
            preamble += MEGATRON_ARGS + f"export DATA={data}\n"
        elif "header" in where:
            preamble += f"DATA={header_data}\n"
        proc = subprocess.run(
            ["bash", "-c", preamble + block], cwd=work, env=block_env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        # Kept for reading when a command fails (and for quoting a result line in the docs).
        (work / "logs" / f"{number:02d}.log").write_text(block + proc.stdout + proc.stderr)
        return proc

    (work / "logs").mkdir()
    blocks = list(enumerate(documented_commands(), start=1))
    # The README's setup block first: its shell's environment is the reader's for every block (the
    # GPU blocks before it are for an environment with megatron_ext installed; this is one).
    [(number, (where, setup))] = [(n, wb) for n, wb in blocks if ACTIVATE in wb[1]]
    assert where == "README.md", where
    # Run as written, `make setup` must find .venv current, as after CI's own `make setup`: were it
    # not, it would reinstall the editable package from this temporary copy of the layout.
    current = subprocess.run(["make", "-q", "setup"], cwd=ROOT, capture_output=True)
    assert current.returncode == 0, "run `make setup` first: .venv is older than the pins"
    found = subprocess.run(["bash", "-c", "command -v megatron-ext"], env=env, cwd=work)
    assert found.returncode != 0  # not on the clean PATH: only the setup lines put it there
    environment = work / "logs" / "environment"
    setup_proc = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{setup}env -0 > {environment}\n"], cwd=work, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert setup_proc.returncode == 0, setup_proc.stdout[-2000:] + setup_proc.stderr[-2000:]
    env = dict(line.split("=", 1) for line in environment.read_text().split("\0") if "=" in line)
    env.pop("PWD", None), env.pop("OLDPWD", None), env.pop("SHLVL", None)
    blocks = [(n, wb) for n, wb in blocks if n != number]
    # The GPU launches' ``python3 -m megatron_ext.pretrain_gpt ... --dry-run`` (the activated
    # python3, through the torchrun stand-in or an example's launcher) is forked from one server
    # that imported Megatron under their environment, which it starts importing now
    # (tests/dry_run_server.py: the same command's code path after the imports,
    # its output, exit status and the rest of the block as written).
    gpu_env = dict(env, PATH=f"{bin_dir}:{env['PATH']}", DRY_RUN="1")
    server = doc_dry_runs["server"] = DryRunServer(
        tmp_path_factory.mktemp("doc_dry_run_server"), gpu_env, DRY_RUN_TIME, python=None,
        name="python3", cwd=work,
    )  # fmt: skip
    # The GPU launches are dry runs of DATA's files, and the headers' data commands write only
    # their own DATA: neither writes what another block reads. They run one at a time beside the
    # other blocks (mostly one core each), both in the documents' order.
    with ThreadPoolExecutor(max_workers=1) as beside:
        apart = {
            n: beside.submit(run, n, *wb)
            for n, wb in blocks
            if is_gpu_launch(wb[1]) or "header" in wb[0]
        }
        procs = {n: run(n, *wb) for n, wb in blocks if n not in apart}
        procs.update({n: future.result() for n, future in apart.items()})
    return [("README.md", setup, setup_proc)] + [
        (where, block, procs[n]) for n, (where, block) in blocks
    ]


def test_every_documented_command_runs_as_written(doc_runs) -> None:
    failed = [
        f"{where}:\n{block}\n-> exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"
        for where, block, proc in doc_runs
        if proc.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)
    # The README's 8 blocks that run here (its setup lines first), docs/examples.md's Slurm launch,
    # a header's data command.
    assert len(doc_runs) == 10, [where for where, _, _ in doc_runs]
    gpu = [proc for _, block, proc in doc_runs if is_gpu_launch(block)]
    assert len(gpu) == 4  # one per feature, and the Slurm launch of docs/examples.md
    assert all("megatron_ext: dry run OK" in proc.stdout for proc in gpu)


def test_the_gpu_launches_dry_runs_are_forked_from_the_server(doc_runs, doc_dry_runs) -> None:
    """Each GPU launch's dry run ran forked (what a fresh python3 would have run: the server's
    interpreter, environment and entry), not as a fresh interpreter."""
    records = doc_dry_runs["server"].records()
    assert len(records) == 4 and all(r["forked"] for r in records), records


def test_the_readmes_losses_are_what_the_cpu_demo_prints(doc_runs) -> None:
    stated = re.search(
        r"`lm loss` over (\d+) iterations: ([\d., ]+)\.\n", (ROOT / "README.md").read_text()
    )
    assert stated, "the README no longer quotes the CPU demo's losses"
    [demo] = [proc for _, block, proc in doc_runs if "bash examples/cpu_demo.sh" in block]
    logged = re.findall(r"lm loss: (\S+) ", demo.stdout + demo.stderr)
    assert len(logged) == int(stated.group(1))
    assert [f"{float(x):.6f}" for x in logged] == stated.group(2).split(", ")


def test_the_readmes_cpu_launch_of_the_blended_example_trains(doc_runs, doc_work) -> None:
    """``CPU=1`` on examples/pretrain_moe_blended.sh as the README gives it (2 gloo processes, tiny
    sizes): its --bf16, Transformer Engine and parallel sizes are dropped or translated, one line
    each; HybridModel trains on the weighted blend with self-padded samples, logs the aux loss and
    the expert load, evaluates on the validation and test splits, and saves every EP rank's experts."""
    from megatron.core import dist_checkpointing

    [(block, proc)] = [(b, p) for _, b, p in doc_runs if "CPU=1" in b]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("CPU=1: ")]
    assert notes == [
        "CPU=1: --transformer-impl transformer_engine -> local (Megatron's own modules)",
        "CPU=1: --bf16 dropped (the CPU loop trains in fp32)",
        "CPU=1: --expert-model-parallel-size 8 -> 2 (2 processes)",
        "CPU=1: --expert-tensor-parallel-size 1 (EP 2 x expert TP 2 would need 4 processes)",
    ]
    run = LoopRun(argv=[block], returncode=proc.returncode, output=proc.stdout + proc.stderr)
    assert_trains(run)
    assert "HybridModel: pp_rank=0/1, vp_stage=0, segment_index=0/1, layers='*E*E'" in run.output
    field_per_iteration(run, "load_balancing_loss")  # --moe-router-load-balancing-type aux_loss
    expert_load_lines(run)  # --moe-expert-load-metrics
    assert "building SelfPaddedGPTDataset" in run.output  # --pad-policy self on GPTDataset
    blend = "blend=(['out/data/web_text_document', 'out/data/code_text_document'], [0.7, 0.3])"
    assert blend in run.output
    for split in ("validation", "test"):  # --split 98,1,1: evaluated at the end
        assert re.search(
            rf"validation loss at iteration 4 on {split} set \| lm loss value: \d", run.output
        )
    # --save: the final iteration, in torch_dist, holding every EP rank's experts (all 8).
    ckpt = doc_work / "out" / "ckpt_pretrain"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
    metadata = dist_checkpointing.load_tensors_metadata(str(ckpt / f"iter_{ITERATIONS:07d}"))
    expert_shapes = {k: tuple(v.global_shape) for k, v in metadata.items() if ".experts." in k}
    assert expert_shapes and all(TINY_EXPERTS in shape for shape in expert_shapes.values())
