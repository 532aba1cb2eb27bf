#!/usr/bin/env bash
# GPU check of megatron_ext's MoE grouped-GEMM alignment (issue 4) on one GPU (H200 class).
# Hardware/software: 1 GPU, torch 2.11 + CUDA 13 preinstalled, NO network, NO Transformer Engine.
# Command: bash tools/gpu_check.sh        (well under 8 minutes; prints one JSON line)
# It installs megatron-core from the wheel kept in tools/gpu/ (no network), then runs
# tools/gpu/gpu_check.py: an AlignedMoELayer feeding torch._scaled_grouped_mm (fp8), our alignment
# under torch.cuda.set_sync_debug_mode("error"), fp8 vs bf16 error, time vs router padding.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  "$PY" -m pip install --no-index --no-deps tools/gpu/megatron_core-0.19.2-*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCHDYNAMO_DISABLE=1
timeout 420 "$PY" tools/gpu/gpu_check.py "$@"
