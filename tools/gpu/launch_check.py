"""The GPU launch's own startup and one real ``pretrain_gpt`` launch on the lent GPU (tools/gpu_check.sh).

1. The startup check as a GPU launch runs it (``check_megatron`` over the rows a launch without
   ``--cpu`` applies), with whatever Transformer Engine this machine has: where TE imports, Megatron
   binds its fused RoPE kernel, the case that refused every GPU launch before (issue 43).
2. ``torchrun --nproc-per-node 1 -m megatron_ext.pretrain_gpt``: a tiny MoE GPTModel, bf16, self
   pads, ``--moe-dispatch-align``, a few iterations on the shipped corpus; Transformer Engine's
   modules (``--transformer-impl transformer_engine``) where TE imports, else Megatron's local ones,
   and the JSON line says which ran.

Prints one JSON line; exit 1 if the check refused or the launch failed. ``--cpu-smoke``: the same
path on CPU (``--cpu``, 1 gloo rank). CI runs its checks and flags with the tests' forked launcher
(tests/moe/test_gpu_check.py), not its torchrun.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 3
#: A tiny MoE GPTModel on one GPU (EP 1), its data the shipped corpus (byte-level, vocabulary 257).
MODEL = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--seq-length", "256", "--max-position-embeddings", "256",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "128", "--moe-token-dispatcher-type", "alltoall",
    "--moe-grouped-gemm", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--lr-decay-style", "constant", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
    "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--train-iters", str(ITERATIONS), "--seed", "7", "--pad-policy", "self",
    "--moe-dispatch-align", "--num-workers", "0",
]  # fmt: skip
_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")


def startup_check(cpu: bool) -> dict:
    """The launch's startup check on this machine, and what Transformer Engine made of RoPE."""
    from megatron_ext.compat.check import check_megatron, launch_groups

    refused = check_megatron(groups=launch_groups(cpu=cpu, dry_run=False))
    from megatron.core.models.common.embeddings import rope_utils

    fused = rope_utils.fused_apply_rotary_pos_emb
    return {
        "ok": refused is None,
        "refused": refused,
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "fused_rope": None if fused is None else f"{fused.__module__}.{fused.__qualname__}",
    }


def pretrain_flags(cpu: bool, te: bool, prefix: str) -> list[str]:
    """The launch's ``pretrain_gpt`` flags: Transformer Engine's modules where TE imports (not
    under ``--cpu``), else Megatron's local ones."""
    impl = "transformer_engine" if te and not cpu else "local"
    device = ["--cpu"] if cpu else ["--bf16"]
    return [*MODEL, *device, "--transformer-impl", impl, "--data-path", prefix]


def result(flags: list[str], returncode: int, output: str) -> dict:
    """What a launch of ``flags`` did: its exit status and the losses it logged."""
    losses = {int(i): float(v) for i, v in _LOSS.findall(output)}
    return {
        "transformer_impl": flags[flags.index("--transformer-impl") + 1],
        "returncode": returncode,
        "losses": [losses[i] for i in sorted(losses)],
        "ok": returncode == 0 and sorted(losses) == list(range(1, ITERATIONS + 1)),
        "tail": "" if returncode == 0 else output[-1500:],
    }


def launch(cpu: bool, te: bool, work: Path) -> dict:
    """One ``pretrain_gpt`` launch under torchrun on the shipped corpus."""
    prefix = work / "corpus_text_document"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input",
         str(ROOT / "megatron_ext/assets/corpus.jsonl"), "--output-prefix", str(prefix),
         "--append-eod"],
        check=True, capture_output=True,
    )  # fmt: skip
    flags = pretrain_flags(cpu, te, str(prefix))
    port = os.environ.get("MASTER_PORT", "29534")
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", port, "-m", "megatron_ext.pretrain_gpt", *flags,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=work)
    return result(flags, done.returncode, done.stdout + done.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the same path on CPU (CI)")
    args = parser.parse_args()
    result = {"startup_check": startup_check(args.cpu_smoke)}
    with tempfile.TemporaryDirectory(prefix="megatron_ext_launch_check_") as work:
        te = result["startup_check"]["transformer_engine"]
        result["launch"] = launch(args.cpu_smoke, te, Path(work))
    result["ok"] = result["startup_check"]["ok"] and result["launch"]["ok"]
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
