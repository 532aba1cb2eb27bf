# Shared launcher for the example scripts (sourced, not run). Reads the multi-node environment,
# then runs megatron_ext.pretrain_gpt under torchrun (megatron_ext.launcher: torchrun that exits with
# the failed rank's status, 2 for a refused flag), or validates the flags only when DRY_RUN=1.
#   NNODES (1)  NODE_RANK (0)  MASTER_ADDR (localhost)  MASTER_PORT (6000); under Slurm from
#     SLURM_NNODES, SLURM_NODEID and the first host of SLURM_JOB_NODELIST (explicit values win)
#   GPUS_PER_NODE (8; 2 with CPU=1): processes per node
#   PYTHON (python3): an interpreter that imports megatron_ext, e.g. the project's .venv/bin/python
#   DRY_RUN (0): 1 = parse and validate every flag with Megatron's parser plus
#   megatron_ext's, print the resolved configuration and exit (no GPU needed; the data files under
#   DATA are checked to exist, and route files to match the model).
#   CPU (0): 1 = the same script, for real, on this machine's CPUs over gloo (a laptop, CI): appends
#     `--cpu --transformer-impl local` (Transformer Engine modules and fused kernels swapped for
#     Megatron's local, unfused equivalents; fp8/fp4 flags become a rehearsal) and CPU_SIZES.
#   MODEL (hybrid): the model class. hybrid = HybridModel (Megatron 0.19.2 deprecates GPTModel for
#     it): the script's N transformer layers as `--hybrid-layer-pattern` of N "*E" (attention, then
#     MoE: 2N Megatron layers; Megatron derives --num-layers from the pattern). gpt = GPTModel with
#     `--num-layers N`, the same layers (e.g. to load a GPTModel checkpoint: neither class's
#     checkpoint loads into the other).
#   CPU_SIZES: with CPU=1, the tiny sizes appended after the script's flags (default below; Megatron
#     takes the last value of a repeated flag, so they replace the script's sizes), after
#     CPU_LAYERS (2) transformer layers of MODEL's class.
#     With CPU=1 the flags the CPU loop cannot run are dropped or translated, one line each on
#     stderr (cpu_translate below): --bf16/--fp16 dropped (the CPU loop trains in fp32),
#     --transformer-impl transformer_engine -> local, parallel sizes larger than the CPU world
#     shrunk to it (experts not split over TP, so EP fits; CP to the ranks TP leaves, e.g. CP 4 -> 2
#     on 2 processes), and a --pretrained-checkpoint that holds
#     no checkpoint dropped (the tiny CPU model starts from random weights: the script's base
#     checkpoint, of the full-size model, could not load into it anyway).
#   CPU_DROP: with CPU=1, more flags of the script to leave out with their values; default none.
#   OVERRIDES: flags appended last of all, e.g. other parallel sizes:
#     CPU=1 OVERRIDES="--tensor-model-parallel-size 1" bash examples/pretrain_moe_blended.sh
#     OVERRIDES is split on spaces: a path with spaces goes after the script name instead (flags
#     given to the script).
# Flags given to the script itself are appended after the script's own (before CPU_SIZES).
# Under Slurm (sbatch/srun: one task per node), the nodes come from Slurm unless set explicitly:
#   NNODES <- SLURM_NNODES, NODE_RANK <- SLURM_NODEID, MASTER_ADDR <- first host of SLURM_JOB_NODELIST.
first_slurm_host() {
  # "gpu[03-05,07],cpu1" -> gpu03; scontrol when present, else the list's own syntax.
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1" | head -n 1
    return
  fi
  local first=${1%%,*}
  if [[ $1 =~ ^([^,\[]+)\[([^],-]+) ]]; then
    first="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
  fi
  echo "$first"
}
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  NNODES=${NNODES:-${SLURM_NNODES:-1}}
  NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
  MASTER_ADDR=${MASTER_ADDR:-$(first_slurm_host "$SLURM_JOB_NODELIST")}
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
if [ "${CPU:-0}" = "1" ]; then
  GPUS_PER_NODE=${GPUS_PER_NODE:-2}
else
  GPUS_PER_NODE=${GPUS_PER_NODE:-8}
fi
PYTHON=${PYTHON:-python3}
# The interpreter must be the environment megatron_ext is installed in (Python >= 3.12, Megatron-Core
# importable): say so in one line rather than a traceback from inside Megatron on every rank.
check_python() {
  "$PYTHON" -c 'import importlib.util as u, sys
sys.exit(0 if sys.version_info >= (3, 12) and u.find_spec("megatron_ext")
         and u.find_spec("megatron") and u.find_spec("megatron.core") else 3)' 2>/dev/null && return
  echo "error: PYTHON=$PYTHON is not an environment with megatron_ext and megatron-core on" \
    "Python >= 3.12: activate it (e.g. 'make setup' then 'source .venv/bin/activate') or set" \
    "PYTHON=/path/to/its/python" >&2
  exit 2
}
# Megatron asserts this with tensor or context parallelism on pre-Blackwell GPUs.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
MODEL=${MODEL:-hybrid}
# A 2-layer, 8-expert top-2 model of hidden size 64, 4 iterations of 8 sequences of 128 tokens at a
# constant learning rate a tiny model learns from in 4 steps.
CPU_LAYERS=${CPU_LAYERS:-2}
CPU_SIZES=${CPU_SIZES:-"--hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128 --num-experts 8 --moe-router-topk 2
  --moe-ffn-hidden-size 64 --micro-batch-size 1 --global-batch-size 8 --train-iters 4
  --lr 1e-3 --min-lr 0 --lr-decay-style constant --lr-warmup-iters 0 --log-interval 1"}

# model_layers N: MODEL_ARGS = N transformer layers (attention + MoE) of MODEL's class, e.g.
#   hybrid, N=2: --hybrid-layer-pattern '*E*E'    gpt, N=2: --num-layers 2
model_layers() {
  local pattern="" i
  case "$MODEL" in
    hybrid)
      for ((i = 0; i < $1; i++)); do pattern+="*E"; done
      MODEL_ARGS=(--hybrid-layer-pattern "$pattern") ;;
    gpt) MODEL_ARGS=(--num-layers "$1") ;;
    *) echo "MODEL=$MODEL: expected hybrid (HybridModel) or gpt (GPTModel)" >&2; exit 2 ;;
  esac
}

# cpu_translate ARGS...: CPU_ARGS = ARGS with what the CPU loop cannot run dropped or translated,
# one "CPU=1: ..." line each on stderr. Megatron takes the last value of a repeated flag.
cpu_translate() {
  local world=$((NNODES * GPUS_PER_NODE)) args=("$@") i=0 flag value tp=1 ep=1 etp="" cp=1
  CPU_ARGS=()
  while [ "$i" -lt "${#args[@]}" ]; do
    flag=${args[i]} value=${args[i + 1]:-}
    case "$flag" in
      --bf16 | --fp16)
        echo "CPU=1: $flag dropped (the CPU loop trains in fp32)" >&2
        i=$((i + 1)); continue ;;
      --transformer-impl)
        if [ "$value" = transformer_engine ]; then
          echo "CPU=1: --transformer-impl transformer_engine -> local (Megatron's own modules)" >&2
          value=local
        fi ;;
      --tensor-model-parallel-size | --expert-model-parallel-size)
        if [ "$value" -gt "$world" ]; then
          echo "CPU=1: $flag $value -> $world ($world processes)" >&2
          value=$world
        fi
        if [ "$flag" = --tensor-model-parallel-size ]; then tp=$value; else ep=$value; fi ;;
      --context-parallel-size) cp=$value ;;
      --expert-tensor-parallel-size) etp=$value ;;
      --pretrained-checkpoint)
        if [ ! -f "$value/latest_checkpointed_iteration.txt" ]; then
          echo "CPU=1: --pretrained-checkpoint $value dropped: it holds no checkpoint, so the tiny" \
            "CPU model starts from random weights (a base checkpoint of the full-size model would" \
            "not load into it; put one of the CPU model there to fine-tune it)" >&2
          i=$((i + 2)); continue
        fi ;;
      *) CPU_ARGS+=("$flag"); i=$((i + 1)); continue ;;
    esac
    CPU_ARGS+=("$flag" "$value")
    i=$((i + 2))
  done
  # Context parallelism shares the world with TP: CP x TP ranks must fit it (the last value wins).
  if [ "$((cp * tp))" -gt "$world" ]; then
    echo "CPU=1: --context-parallel-size $cp -> $((world / tp)) ($world processes, TP $tp)" >&2
    CPU_ARGS+=(--context-parallel-size "$((world / tp))")
  fi
  # The experts' grid (expert TP x EP, expert TP defaulting to TP) must fit the world as well.
  if [ "$((${etp:-$tp} * ep))" -gt "$world" ]; then
    echo "CPU=1: --expert-tensor-parallel-size 1 (EP $ep x expert TP ${etp:-$tp} would need" \
      "$((${etp:-$tp} * ep)) processes)" >&2
    CPU_ARGS+=(--expert-tensor-parallel-size 1)
  fi
}

launch() {
  check_python
  local extra=()
  if [ "${CPU:-0}" = "1" ]; then
    if [ -n "${CPU_DROP:-}" ]; then
      local kept=() arg dropping=0
      for arg in "$@"; do
        case "$arg" in --*) dropping=0 ;; esac
        case " $CPU_DROP " in *" $arg "*) dropping=1 ;; esac
        [ "$dropping" = "1" ] || kept+=("$arg")
      done
      set -- "${kept[@]}"
    fi
    cpu_translate "$@"
    set -- "${CPU_ARGS[@]}"
    local sizes=()
    # Word splitting only (read -a does no glob expansion: "*E*E" patterns stay as written).
    read -r -d '' -a sizes <<<"$CPU_SIZES" || true
    model_layers "$CPU_LAYERS"
    extra+=(--cpu --transformer-impl local "${MODEL_ARGS[@]}" "${sizes[@]}")
  fi
  if [ -n "${OVERRIDES:-}" ]; then
    local overrides=()
    read -r -d '' -a overrides <<<"$OVERRIDES" || true
    extra+=("${overrides[@]}")
  fi
  if [ "${DRY_RUN:-0}" = "1" ]; then
    echo "launch: nnodes=$NNODES node_rank=$NODE_RANK master_addr=$MASTER_ADDR" \
      "nproc_per_node=$GPUS_PER_NODE" >&2
    # Validate against the world size the job will have, not this login node's.
    WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) RANK=0 exec "$PYTHON" -m megatron_ext.pretrain_gpt \
      "$@" "${extra[@]}" --dry-run
  fi
  exec "$PYTHON" -m megatron_ext.launcher --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_ext.pretrain_gpt "$@" "${extra[@]}"
}
