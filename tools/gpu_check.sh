#!/usr/bin/env bash
# GPU check of megatron_ext's MoE grouped-GEMM alignment on one GPU (H200 class).
# Hardware/software: 1 GPU, torch 2.11 + CUDA 13 preinstalled, NO network, NO Transformer Engine.
# Command: bash tools/gpu_check.sh        (well under 8 minutes; prints one JSON line, exit 1 on
# a failed check). It installs megatron-core from the wheel kept in tools/gpu/ (no network, so
# --no-deps: a preflight checks its dependencies first), then runs tools/gpu/gpu_check.py: an
# AlignedMoELayer feeding torch._scaled_grouped_mm (fp8), the dispatcher's pad/strip in the real
# forward/backward under torch.cuda.set_sync_debug_mode("error"), fp8 vs bf16 within an
# e4m3-derived bound, time vs router padding; then route replay on the GPU (install() under the
# same sync guard, exact replay, replay vs native and Megatron's RouterReplay timed) and the
# alignment benchmark's EP=1 rows (ours/unaligned dispatch + combine at 48 and 8192
# tokens, both dispatchers).
# First of all, tools/gpu/launch_check.py: the startup check a GPU launch runs (over the rows a launch
# without --cpu applies) and one `torchrun -m megatron_ext.pretrain_gpt` launch on the GPU (bf16, a
# tiny MoE GPTModel, 3 iterations), with Transformer Engine's modules where TE imports, else
# Megatron's local ones; its JSON line says which. The lent machines have no TE, and it cannot be
# carried to them: TE 2.20's core wheel is 276 MB (over the 64 MiB a call carries) and its torch
# binding is published as source only. Each step prints its JSON line; exit 1 if either failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # Debian and Ubuntu have no plain "python" unless a venv adds one

# Preflight: megatron-core 0.19.2 requires torch>=2.6, numpy, packaging>=24.2 (its wheel
# METADATA); --no-deps below cannot fetch them offline, so say what is missing up front.
missing=$("$PY" - <<'PYEOF'
import importlib.util
missing = [m for m in ("torch", "numpy", "packaging") if importlib.util.find_spec(m) is None]
if not missing:
    import packaging.version, torch
    if packaging.version.parse(torch.__version__.split("+")[0]) < packaging.version.parse("2.6"):
        missing.append(f"torch>=2.6 (found {torch.__version__})")
print(" ".join(missing))
PYEOF
) || { echo "gpu_check: '$PY' cannot run Python; set PYTHON=/path/to/python3.12" >&2; exit 2; }
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python packages for megatron-core: $missing" >&2
  echo "gpu_check: this machine has no network; install them from local wheels first" >&2
  exit 2
fi

if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  "$PY" -m pip install --no-index --no-deps tools/gpu/megatron_core-0.19.2-*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCHDYNAMO_DISABLE=1
if ! err=$("$PY" -c "import megatron.core, megatron_ext.moe.moe_layer" 2>&1); then
  echo "gpu_check: importing megatron.core / megatron_ext failed (a dependency missing?):" >&2
  echo "$err" | tail -5 >&2
  exit 2
fi
status=0
timeout 150 "$PY" tools/gpu/launch_check.py || status=1
timeout 420 "$PY" tools/gpu/gpu_check.py "$@" || status=1
exit $status
