#!/usr/bin/env bash
# Supervised fine-tuning on CPU, the paper's Sec. 5.3 at the tiny size: the demo's baseline
# and JREG checkpoints are fine-tuned on a built-in chat set (generated, no download), then
# the jump of both fine-tuned models is measured (the layout of the paper's Table 7).
# Runs examples/demo.sh first when the demo's checkpoints are missing.
#   OUT=runs/demo SFT_ITERS=100 SFT_JREG_LAMBDA=0 bash examples/sft_tiny.sh
# SFT_JREG_LAMBDA (default 0): the JREG weight during fine-tuning; the paper's SFT recipe
# names no JREG term, so both models are fine-tuned the same way by default.
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
OUT=${OUT:-$REPO/runs/demo}
DATA_DIR="$OUT/data"
cd "$REPO"
start=$(date +%s)

for lambda in 0 1.0; do
  if [ -z "$(load_args "$OUT/tiny_lambda$lambda/checkpoints")" ]; then
    echo "== the demo's checkpoints are missing: running examples/demo.sh first"
    OUT="$OUT" bash examples/demo.sh
    break
  fi
done

echo "== 1/3 chat data: the built-in demo conversations, the demo's tokenizer"
[ -f "$DATA_DIR/chat.jsonl" ] || python tools/make_demo_corpus.py --chat --output "$DATA_DIR/chat.jsonl"
[ -f "$DATA_DIR/chat_sft_document.idx" ] || python tools/preprocess_data.py --sft \
  --input "$DATA_DIR/chat.jsonl" --output-prefix "$DATA_DIR/chat" \
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$DATA_DIR/tokenizer.model" --workers 2

for lambda in 0 1.0; do
  run="$OUT/sft_from_lambda$lambda"
  echo "== 2/3 SFT of the $([ "$lambda" = 0 ] && echo baseline || echo JREG) checkpoint into $run"
  run_trainer --sft --model-preset tiny --seq-length 192 \
    --pretrained-checkpoint "$OUT/tiny_lambda$lambda/checkpoints" --finetune \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "${SFT_ITERS:-100}" \
    --lr 2e-4 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style linear \
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0 --clip-grad 1.0 --seed 1234 \
    --data-path "$DATA_DIR/chat_sft_document" --split 95,5,0 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$DATA_DIR/tokenizer.model" \
    --jreg-lambda "${SFT_JREG_LAMBDA:-0}" \
    --save "$run/checkpoints" --save-interval 100 $(load_args "$run/checkpoints") \
    --eval-interval 50 --eval-iters 2 --log-interval 25 \
    --tensorboard-dir "$run/tensorboard" --metrics-file "$run/metrics.jsonl"
done

echo "== 3/3 the jump after SFT (Table 7 layout: zeta_L, zeta_L-1, zeta_L-2 per model)"
python tools/eval_jump.py \
  --load "$OUT/sft_from_lambda0/checkpoints" "$OUT/sft_from_lambda1.0/checkpoints" \
  --label baseline-sft --label jreg-sft \
  --data-path "$DATA_DIR/demo_text_document" --seq-length 128 --max-tokens 65536 --batch-size 16 \
  --json "$OUT/sft_jump.json" --csv "$OUT/sft_jump.csv"

echo "done in $(( $(date +%s) - start ))s: fine-tuned checkpoints under $OUT/sft_from_lambda*," \
  "jump table in $OUT/sft_jump.json and $OUT/sft_jump.csv"
