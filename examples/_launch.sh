# Shared launcher for the example scripts (sourced, not run). Reads the multi-node environment,
# then runs megatron_ext.pretrain_gpt under torchrun, or validates the flags only when DRY_RUN=1.
#   NNODES (1)  NODE_RANK (0)  MASTER_ADDR (localhost)  MASTER_PORT (6000)  GPUS_PER_NODE (8)
#   PYTHON (python3)  DRY_RUN (0): 1 = parse and validate every flag with Megatron's parser plus
#   megatron_ext's, print the resolved configuration and exit (no GPU, no data access needed).
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python3}
# Megatron asserts this with tensor or context parallelism on pre-Blackwell GPUs.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

launch() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    # Validate against the world size the job will have, not this login node's.
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) RANK=0 exec "$PYTHON" -m megatron_ext.pretrain_gpt "$@" --dry-run
  fi
  exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" -m megatron_ext.pretrain_gpt "$@"
}
