#!/usr/bin/env bash
# The whole pipeline on the built-in demo, CPU included: build the demo corpus (Python
# standard-library docstrings, no download), train a small tokenizer, preprocess, train the
# tiny preset without and with JREG (same seed and data), then measure both checkpoints
# with eval_jump: the per-layer displacement side by side, zeta, and a plot.
#   OUT=runs/demo  TRAIN_ITERS=300  bash examples/demo.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$REPO/runs/demo}
export DATA_DIR="$OUT/data"
cd "$REPO"
start=$(date +%s)

echo "== 1/4 demo data (corpus, tokenizer, indexed dataset) in $DATA_DIR"
bash examples/prepare_demo_data.sh

for lambda in 0 1.0; do
  echo "== $([ "$lambda" = 0 ] && echo 2/4 baseline || echo 3/4 JREG): tiny preset, lambda=$lambda"
  JREG_LAMBDA=$lambda RUN_DIR="$OUT/tiny_lambda$lambda" TRAIN_ITERS=${TRAIN_ITERS:-300} \
    bash examples/pretrain_tiny_jreg.sh
done

echo "== 4/4 eval_jump on both checkpoints"
python tools/eval_jump.py \
  --load "$OUT/tiny_lambda0/checkpoints" "$OUT/tiny_lambda1.0/checkpoints" --label baseline --label jreg \
  --data-path "$DATA_DIR/demo_text_document" --seq-length 128 --max-tokens 65536 --batch-size 16 \
  --compare --json "$OUT/jump.json" --csv "$OUT/jump.csv" --plot "$OUT/jump.png"

echo "done in $(( $(date +%s) - start ))s: checkpoints, TensorBoard logs and metrics under $OUT," \
  "jump table in $OUT/jump.json and $OUT/jump.csv, plot in $OUT/jump.png"
