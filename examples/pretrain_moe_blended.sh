#!/usr/bin/env bash
# What: MoE pretraining of a HybridModel (16 transformer layers, pattern "*E" x 16: attention then MoE;
#   64 experts, top-6, bf16) on a weighted blend of two corpora, with megatron_ext's self-token padding
#   (short samples padded with their own tokens, not token 0) and per-expert / per-EP-rank load metrics
#   in TensorBoard. MODEL=gpt trains the same layers as a GPTModel (deprecated in Megatron 0.19).
# Hardware: 4 nodes x 8 H100/H200 (TP 2, EP 8, PP 1, DP 16).
# Command: NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_moe_blended.sh
#   (NODE_RANK=1, 2, 3 on the other nodes; DRY_RUN=1 validates every flag, and the files under DATA,
#   on any machine and exits; CPU=1 runs it on this machine's CPUs: docs/examples.md.)
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
DATA=${DATA:-/data/corpora}
CKPT=${CKPT:-/checkpoints/moe_pretrain}

model_layers 16  # MODEL_ARGS: --hybrid-layer-pattern '*E*E...' (MODEL=gpt: --num-layers 16)
ARGS=(
  # model
  "${MODEL_ARGS[@]}" --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
  --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
  --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1024 --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --transformer-impl transformer_engine --bf16
  # parallelism
  --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 8
  # data: weighted blend, Megatron's split, self-token padding of short samples
  --data-path 0.7 "$DATA/web_text_document" 0.3 "$DATA/code_text_document" --split 98,1,1
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/tokenizer"
  --pad-policy self
  # megatron_ext: expert load (max_vio with and without pads) to TensorBoard
  --moe-expert-load-metrics
  # training
  --micro-batch-size 1 --global-batch-size 512 --train-iters 100000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0
  --save "$CKPT" --load "$CKPT" --save-interval 1000 --log-interval 10 --tensorboard-dir "$CKPT/tb"
  # Megatron 0.19.2 has no default --eval-interval: pretrain() fails at startup without one.
  --eval-interval 1000 --eval-iters 10
)
launch "${ARGS[@]}" "$@"
