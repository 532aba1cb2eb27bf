#!/usr/bin/env bash
# What: fp8 MoE SFT of a HybridModel (16 transformer layers, pattern "*E" x 16: attention then MoE) on
#   packed conversations (prompt tokens loss-masked via a sidecar), every pack padded to --seq-length
#   with the pack's own tokens (static shapes: torch.compile / CUDA graphs stop recompiling) and every
#   expert's token group aligned to the fp8 grouped-GEMM multiple after dispatch (16; 32 with
#   RECIPE=mxfp8), with no extra host sync and no extra all-to-all traffic. The base checkpoint must
#   be of the same class: MODEL=gpt for a GPTModel one (deprecated in Megatron 0.19).
# Hardware: 2 nodes x 8 H100/H200 (fp8 needs Hopper or newer; mxfp8 needs Blackwell). TP 1, EP 8, DP 16.
# Command: NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RECIPE=tensorwise bash examples/sft_fp8_moe_packed.sh
#   Data: megatron-ext preprocess-data --input sft.jsonl --prompt-key prompt --response-key response \
#     --append-eod --output-prefix "$DATA/chat_text_document"
#   (NODE_RANK=1 on the other node; the data command also writes the prompt mask,
#   chat_text_document_loss_mask, and takes --tokenizer-model "$DATA/tokenizer"; DRY_RUN=1 validates
#   every flag, and the files under DATA, on any machine and exits.)
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
DATA=${DATA:-/data/sft}
CKPT=${CKPT:-/checkpoints/moe_sft}
RECIPE=${RECIPE:-tensorwise}   # tensorwise | delayed | blockwise | mxfp8

model_layers 16  # MODEL_ARGS: --hybrid-layer-pattern '*E*E...' (MODEL=gpt: --num-layers 16)
ARGS=(
  "${MODEL_ARGS[@]}" --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
  --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
  --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1024 --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --transformer-impl transformer_engine --bf16 --fp8-format e4m3 --fp8-recipe "$RECIPE"
  --expert-model-parallel-size 8
  # megatron_ext: aligned dispatch replaces --moe-router-padding-for-quantization (refused together)
  --moe-dispatch-align --moe-expert-load-metrics
  # data: whole conversations packed best-fit, self-padded to exactly --seq-length
  --data-path "$DATA/chat_text_document" --split 99,1,0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/tokenizer"
  --pack-documents --packing-algorithm best_fit --pack-overlong-policy truncate
  --pack-loss-mask-suffix _loss_mask --pad-policy self --pad-to-seq-len
  --micro-batch-size 1 --global-batch-size 128 --train-iters 2000
  --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.0 --clip-grad 1.0
  # Fine-tunes $CKPT/base; a restarted job resumes from its own saves in $CKPT (Megatron falls back to
  # --pretrained-checkpoint only while --load has none, and fails if neither has one).
  --pretrained-checkpoint "$CKPT/base" --load "$CKPT" --save "$CKPT" --save-interval 500 --log-interval 10
  # Megatron 0.19.2 has no default --eval-interval: pretrain() fails at startup without one.
  --eval-interval 500 --eval-iters 10
)
launch "${ARGS[@]}" "$@"
