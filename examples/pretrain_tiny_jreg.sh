#!/usr/bin/env bash
# The tiny preset on the demo corpus: the full training code path on a laptop CPU in about
# a minute. JREG_LAMBDA=0 gives the baseline; MODEL_PRESET=gpt2-tiny, qwen3-tiny or
# mixtral-tiny trains the tiny size of another family. Builds the demo data first if needed.
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
DATA_DIR=${DATA_DIR:-$REPO/runs/demo/data}
if [ -z "${DATA_PATH:-}" ]; then
  DATA_DIR="$DATA_DIR" bash "$REPO/examples/prepare_demo_data.sh"
  DATA_PATH="$DATA_DIR/demo_text_document"
  TOKENIZER_TYPE=GPTSentencePieceTokenizer
  TOKENIZER_MODEL="$DATA_DIR/tokenizer.model"
fi
JREG_LAMBDA=${JREG_LAMBDA:-1.0}
RUN_DIR=${RUN_DIR:-$REPO/runs/demo/tiny_lambda${JREG_LAMBDA}}
cd "$REPO"
run_trainer \
  --model-preset "${MODEL_PRESET:-tiny}" --seq-length 128 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters ${TRAIN_ITERS:-300} \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 \
  --data-path $DATA_PATH --split 98,2,0 \
  --tokenizer-type "${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}" --tokenizer-model "$TOKENIZER_MODEL" \
  --jreg-lambda "$JREG_LAMBDA" --jreg-alpha "${JREG_ALPHA:-1.0}" \
  --save "$RUN_DIR/checkpoints" --save-interval 100 $(load_args "$RUN_DIR/checkpoints") \
  --eval-interval 100 --eval-iters 4 --log-interval 25 \
  --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl"
