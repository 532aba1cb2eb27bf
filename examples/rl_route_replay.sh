#!/usr/bin/env bash
# What: RL policy update (PPO-clip) of a MoE HybridModel (16 transformer layers, pattern "*E" x 16: attention
#   then MoE) on rollouts, replaying the experts the inference engine chose (R3): routes converted from
#   vLLM dumps sit beside the token data, are packed and self-padded with the tokens (a pad replays the
#   route of the token it copies), validated, sliced for SP/CP and installed into Megatron's
#   RouterReplay per micro-batch; the vLLM T-1 final token routes natively. The policy checkpoint must
#   be of the same class: MODEL=gpt for a GPTModel one (deprecated in Megatron 0.19); the route
#   sidecar is the same for both (one top-k row per MoE layer: the config's decoder layers 0-15
#   it records map in order onto the HybridModel's MoE layers 1, 3, ..., 31 or the GPTModel's 0-15).
#   The step is an RL one: the PPO-clip policy loss (--rl-loss ppo, clip 0.2 / 0.28, a token-level
#   mean over the global batch) on the completions (the loss mask) with the rollouts' advantages and
#   the engine's log-probs; it logs rl/logprob_mismatch, rl/clip_fraction, rl/ratio_mean, rl/kl_k3.
#   `megatron-ext ingest-rollouts --token-keys logprobs --sequence-keys advantages=advantage` writes
#   tokens, loss mask, routes, log-probs and advantages from one dump (docs/replay.md).
# Hardware: 1 node x 8 H100/H200 (TP 2 with sequence parallelism, EP 4).
# Command: bash examples/rl_route_replay.sh
#   Routes: megatron-ext convert-routes --format vllm --input rollouts.jsonl --model-config config.json \
#     --tokens-prefix "$DATA/rollouts_text_document" --output-prefix "$DATA/rollouts_text_document_routes"
#   (config.json: the model's Hugging Face config, for its MoE layers, top-k and experts; the records
#   in the order of the token file's documents; DRY_RUN=1 validates every flag, and the files under
#   DATA, on any machine and exits.)
# Larger: 2 or 8 nodes (16 or 64 GPUs; data-parallel 8 or 32, the same global batch of 64 rollouts).
# Command: NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/rl_route_replay.sh
# Command: NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 bash examples/rl_route_replay.sh
set -euo pipefail
source "$(dirname "$0")/_launch.sh"
DATA=${DATA:-/data/rl}
CKPT=${CKPT:-/checkpoints/moe_rl}

model_layers 16  # MODEL_ARGS: --hybrid-layer-pattern '*E*E...' (MODEL=gpt: --num-layers 16)
ARGS=(
  "${MODEL_ARGS[@]}" --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
  --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
  --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
  --num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1024 --moe-grouped-gemm
  --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --transformer-impl transformer_engine --bf16
  --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4
  # data: packed rollouts, self-padded to --seq-length; routes from tools/convert_routes.py
  --data-path "$DATA/rollouts_text_document" --split 100,0,0
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/tokenizer"
  --pack-documents --packing-algorithm sequential --pad-policy self --pad-to-seq-len
  --route-replay-mode replay --route-data-suffix _routes --replay-missing-route-policy native
  # the policy loss: advantages and behaviour log-probs from $DATA/rollouts_text_document_{advantages,logprobs}
  --pack-loss-mask-suffix _loss_mask --rl-loss ppo --rl-clip-low 0.2 --rl-clip-high 0.28
  --calculate-per-token-loss
  --moe-expert-load-metrics
  --micro-batch-size 1 --global-batch-size 64 --train-iters 500
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0
  # Starts from $CKPT/policy; a restarted job resumes from its own saves in $CKPT (Megatron falls back
  # to --pretrained-checkpoint only while --load has none, and fails if neither has one).
  --pretrained-checkpoint "$CKPT/policy" --load "$CKPT" --save "$CKPT" --save-interval 100 --log-interval 1
  # No validation split (--split 100,0,0): no evaluation. Megatron 0.19.2 would still run one on
  # the missing split at the end (default --eval-iters 100), and needs an --eval-interval anyway.
  --eval-interval 100 --eval-iters 0
)
launch "${ARGS[@]}" "$@"
