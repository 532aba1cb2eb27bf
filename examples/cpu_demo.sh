#!/usr/bin/env bash
# What: megatron_ext on Megatron's real training loop (megatron.training.pretrain), on a laptop: a tiny MoE
#   HybridModel (pattern *E*E: attention + MoE, 8 experts, top-2, EP=2) trained on rollout-style packs (one
#   document per row, padded to the sequence length with the row's own tokens), per-expert / per-EP-rank
#   load metrics, and an fp8 rehearsal of the aligned dispatch (the model computes in fp32; every expert
#   group reaching the grouped GEMM is padded to 16 and checked). `make demo` runs it four times:
#   constant pads, self pads + route recording, self pads skipped (--moe-pad-routing skip), replay of
#   the recorded routes; then an RL step (record with router jitter, --rl-loss ppo with and without
#   replay) for the log-prob agreement.
# Hardware: any machine, CPU only, 2 processes over gloo (--cpu). Copy it to try a launch before a cluster.
# Command: DATA=out/data bash examples/cpu_demo.sh
#   (more flags after the script name win; DATA/corpus_text_document is made as the README says:
#   megatron-ext make-corpus, then megatron-ext preprocess-data --append-eod; DRY_RUN=1 validates every
#   flag and exits)
set -euo pipefail
DATA=${DATA:?set DATA to the directory holding corpus_text_document.bin/.idx}
NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python3}  # the environment megatron_ext is installed in (Python >= 3.12)
if ! "$PYTHON" -c 'import sys, importlib.util as u
sys.exit(0 if sys.version_info >= (3, 12) and u.find_spec("megatron_ext")
         and u.find_spec("megatron") and u.find_spec("megatron.core") else 3)' 2>/dev/null; then
  echo "error: PYTHON=$PYTHON is not an environment with megatron_ext and megatron-core on Python" \
    ">= 3.12: activate it (e.g. source .venv/bin/activate) or set PYTHON" >&2
  exit 2
fi
MASTER_PORT=${MASTER_PORT:-29500}

ARGS=(
  --cpu
  # model: HybridModel (Megatron 0.19's recommended class), local modules
  --hybrid-layer-pattern '*E*E' --num-layers 4 --hidden-size 64 --ffn-hidden-size 128
  --num-attention-heads 4 --seq-length 768 --max-position-embeddings 768 --position-embedding-type rope
  --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0 --hidden-dropout 0 --transformer-impl local
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --expert-model-parallel-size "$NPROC"
  # fp8 rehearsal: groups aligned to 16 after dispatch, checked by the grouped-GEMM backend
  --fp8-format e4m3 --fp8-recipe tensorwise --moe-dispatch-align
  # data: one document per row (rollouts), self-token padding to the sequence length
  --data-path "$DATA/corpus_text_document" --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 257
  --pack-documents --packing-window 1 --pad-to-seq-len --pack-overlong-policy truncate
  --pad-policy self --moe-expert-load-metrics
  # training
  --micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 3e-3 --lr-decay-style constant
  --seed 7 --log-interval 1 --eval-iters 0 --eval-interval 1000
)
if [ "${DRY_RUN:-0}" = "1" ]; then
  WORLD_SIZE=$NPROC RANK=0 exec "$PYTHON" -m megatron_ext.pretrain_gpt "${ARGS[@]}" "$@" --dry-run
fi
exec "$PYTHON" -m megatron_ext.launcher --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" \
  -m megatron_ext.pretrain_gpt "${ARGS[@]}" "$@"
