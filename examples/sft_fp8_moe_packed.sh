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
# Long context (LONG=1): 32k-token packs with context parallelism, CP 4 (CP=N to change it), on 8 nodes
#   (DP 16, EP 8 over the DP x CP ranks). Every conversation is padded to a multiple of 2*CP with its
#   own tokens (Megatron's THD split gives each CP rank two chunks of every document), not one pad id.
# Command: NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 LONG=1 bash examples/sft_fp8_moe_packed.sh
# Megatron's own SFT path (SFT=1): Megatron's SFTDataset on a JSONL of {"messages": [...]} through its
#   SFTTokenizer's chat template (prompts masked by the template), packed whole by best_fit and
#   self-padded; "$DATA/tokenizer" must hold the prompt format's special tokens. One node here.
# Command: NNODES=1 SFT=1 bash examples/sft_fp8_moe_packed.sh
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
DATA=${DATA:-/data/sft}
CKPT=${CKPT:-/checkpoints/moe_sft}
RECIPE=${RECIPE:-tensorwise}   # tensorwise | delayed | blockwise | mxfp8
if [ "${LONG:-0}" = 1 ]; then SEQ=32768 CP=${CP:-4}; else SEQ=8192 CP=${CP:-1}; fi
if [ "${SFT:-0}" = 1 ]; then
  # Megatron's --sft: SFTDataset + SFTTokenizer; megatron_ext packs whole conversations (no truncation)
  DATA_ARGS=(--sft --data-path "$DATA/chat.jsonl" --split 99,1,0
    --tokenizer-type SFTTokenizer --tokenizer-model "$DATA/tokenizer"
    --sft-tokenizer-prompt-format nemotron-h-aligned --sft-packing packed
    --packing-algorithm best_fit --pack-overlong-policy truncate --pad-policy self)
else
  # whole conversations packed best-fit, self-padded to exactly --seq-length
  DATA_ARGS=(--data-path "$DATA/chat_text_document" --split 99,1,0
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/tokenizer"
    --pack-documents --packing-algorithm best_fit --pack-overlong-policy truncate
    --pack-loss-mask-suffix _loss_mask --pad-policy self --pad-to-seq-len)
fi

model_layers 16  # MODEL_ARGS: --hybrid-layer-pattern '*E*E...' (MODEL=gpt: --num-layers 16)
ARGS=(
  "${MODEL_ARGS[@]}" --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" --position-embedding-type rope
  --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1024 --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --transformer-impl transformer_engine --bf16 --fp8-format e4m3 --fp8-recipe "$RECIPE"
  --expert-model-parallel-size 8 --context-parallel-size "$CP"
  # megatron_ext: aligned dispatch replaces --moe-router-padding-for-quantization (refused together)
  --moe-dispatch-align --moe-expert-load-metrics
  "${DATA_ARGS[@]}"
  --micro-batch-size 1 --global-batch-size 128 --train-iters 2000
  --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.0 --clip-grad 1.0
  # Fine-tunes $CKPT/base; a restarted job resumes from its own saves in $CKPT (Megatron falls back to
  # --pretrained-checkpoint only while --load has none, and fails if neither has one).
  --pretrained-checkpoint "$CKPT/base" --load "$CKPT" --save "$CKPT" --save-interval 500 --log-interval 10
  # Megatron 0.19.2 has no default --eval-interval: pretrain() fails at startup without one.
  --eval-interval 500 --eval-iters 10
)
launch "${ARGS[@]}" "$@"
