# Sourced by the pretrain_*.sh scripts: the launcher and the data/tokenizer arguments.
#
# Environment (all optional):
#   GPUS_PER_NODE  processes per node (default: all visible GPUs, 1 on a CPU machine)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node torchrun rendezvous
#   RDZV_ENDPOINT, RDZV_ID   multi-node c10d rendezvous instead (host:port, a job id): every
#                  node runs the same command and torchrun numbers the nodes (Slurm:
#                  examples/slurm/pretrain_3b_jreg.sbatch)
#   DATA_PATH      prefix(es) from tools/preprocess_data.py, optionally weighted ("0.7 a 0.3 b")
#   TOKENIZER_TYPE, TOKENIZER_MODEL   the tokenizer the data was made with
#   RUN_DIR        where checkpoints, TensorBoard logs and metrics go
#   JREG_LAMBDA    0 gives the baseline twin of a JREG script (same everything else)
#   JREG_ALPHA     the depth weighting alpha
#   SEQ_LENGTH     the paper recipe's sequence length (2048; 32768 in the *_long_context.sh
#                  scripts), at the same 2^19 tokens per step (run_paper_recipe below)
#   TRANSFORMER_IMPL  auto (default: Transformer Engine when installed), local or transformer_engine
#   EXTRA_ARGS     more trainer flags, appended last (they override the script's)
#   CUDA_DEVICE_MAX_CONNECTIONS   default 1 (below)

set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
# One hardware queue per GPU, as Megatron-LM's scripts set: megatron-core's tensor- and
# sequence-parallel linears start a collective and then a GEMM, and rely on it to run first.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

launcher() {
  if [ "$NNODES" -gt 1 ] && [ -n "${RDZV_ENDPOINT:-}" ]; then
    echo "torchrun --nnodes $NNODES --nproc_per_node $GPUS_PER_NODE --rdzv_backend c10d \
      --rdzv_endpoint $RDZV_ENDPOINT --rdzv_id ${RDZV_ID:?set RDZV_ID with RDZV_ENDPOINT}"
  elif [ "$NNODES" -gt 1 ]; then
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
# crash or preemption resumes it (also when a kill left no tracker file beside the
# iter_XXXXXXX directories: the trainer then takes the newest whole one). Only a whole
# iteration counts: a save killed half-way (iter_XXXXXXX.partial-...) is not a checkpoint.
load_args() {
  if [ -f "$1/latest_checkpointed_iteration.txt" ] \
      || compgen -G "$1/iter_[0-9][0-9][0-9][0-9][0-9][0-9][0-9]/jreg_complete.json" >/dev/null; then
    echo "--load $1"
  fi
}

# The paper's recipe on GPU nodes, shared by the 170m, 1b and 3b scripts: 100B tokens of
# FineWeb-Edu in 200K steps. The batch size, schedule and optimizer settings here are ours
# (the paper does not give them): 256 sequences x 2048 tokens = 0.52M tokens per step,
# 200000 steps = 105B tokens; cosine decay to a tenth of --lr after 2000 warm-up steps;
# AdamW (0.9, 0.95), weight decay 0.1, clipping at 1.0; bf16, distributed optimizer with its
# gradient reduce-scatter and parameter all-gather overlapped with backward and forward
# (--overlap-grad-reduce --overlap-param-gather: Megatron-LM's DDP flags with the distributed
# optimizer in its Llama 3 and Mixtral examples, whatever the TP size: at 170m and 1b, data
# parallel only, this communication is all the run's communication).
# SEQ_LENGTH (a script's, default 2048) changes the sequence length and keeps the tokens per
# step: the global batch is 2^19 / SEQ_LENGTH sequences (16 x 32768), the run directory names it.
#   run_paper_recipe PRESET [per-model flags: parallel layout, micro-batch, --lr, --min-lr]
run_paper_recipe() {
  local preset=$1 seq=${SEQ_LENGTH:-2048}
  shift
  if ! [[ $seq =~ ^[1-9][0-9]*$ ]] || (( 524288 % seq )); then
    echo "error: SEQ_LENGTH $seq must divide 524288 (2^19 tokens per step): pass a power of two" >&2
    exit 2
  fi
  : "${DATA_PATH:?set DATA_PATH to the prefix(es) written by tools/preprocess_data.py}"
  : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer the data was made with}"
  JREG_LAMBDA=${JREG_LAMBDA:-1.0}
  JREG_ALPHA=${JREG_ALPHA:-1.0}
  RUN_DIR=${RUN_DIR:-$REPO/runs/${preset}$([ "$seq" = 2048 ] || echo "_seq$seq")_lambda${JREG_LAMBDA}_alpha${JREG_ALPHA}}
  cd "$REPO"
  # shellcheck disable=SC2046,SC2086  # DATA_PATH may be a weighted blend "0.7 a 0.3 b"
  run_trainer \
    --model-preset "$preset" --seq-length "$seq" \
    --global-batch-size $((524288 / seq)) --train-iters 200000 \
    --lr-warmup-iters 2000 --lr-decay-style cosine \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --transformer-impl "${TRANSFORMER_IMPL:-auto}" --data-path $DATA_PATH --split 99,1,0 \
    --tokenizer-type "${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}" --tokenizer-model "$TOKENIZER_MODEL" \
    --jreg-lambda "$JREG_LAMBDA" --jreg-alpha "$JREG_ALPHA" --jreg-weighting softmax \
    --save "$RUN_DIR/checkpoints" --save-interval 2000 $(load_args "$RUN_DIR/checkpoints") \
    --eval-interval 2000 --eval-iters 20 --log-interval 10 \
    --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl" \
    "$@"
}
