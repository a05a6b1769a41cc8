# Sourced by the pretrain_*.sh scripts: the launcher and the data/tokenizer arguments.
#
# Environment (all optional):
#   GPUS_PER_NODE  processes per node (default: all visible GPUs, 1 on a CPU machine)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node torchrun rendezvous
#   DATA_PATH      prefix(es) from tools/preprocess_data.py, optionally weighted ("0.7 a 0.3 b")
#   TOKENIZER_TYPE, TOKENIZER_MODEL   the tokenizer the data was made with
#   RUN_DIR        where checkpoints, TensorBoard logs and metrics go
#   JREG_LAMBDA    0 gives the baseline twin of a JREG script (same everything else)
#   JREG_ALPHA     the depth weighting alpha
#   EXTRA_ARGS     more trainer flags, appended last (they override the script's)

set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}

launcher() {
  if [ "$NNODES" -gt 1 ]; then
    echo "torchrun --nnodes $NNODES --node_rank $NODE_RANK --nproc_per_node $GPUS_PER_NODE \
      --master_addr ${MASTER_ADDR:?set MASTER_ADDR for multi-node runs} --master_port ${MASTER_PORT:-29500}"
  elif [ "$GPUS_PER_NODE" -gt 1 ]; then
    echo "torchrun --standalone --nproc_per_node $GPUS_PER_NODE"
  else
    echo "python"
  fi
}

run_trainer() {
  # shellcheck disable=SC2046
  $(launcher) -m megatron_jreg.train "$@" ${EXTRA_ARGS:-}
}

# --load the run's own checkpoints when some exist: re-running the same command after a
# crash or preemption resumes it.
load_args() {
  if [ -f "$1/latest_checkpointed_iteration.txt" ]; then echo "--load $1"; fi
}
