#!/usr/bin/env bash
# Does JREG suppress the final-layer jump beyond Llama? The tiny size of each model family
# (Llama, GPT-2, Qwen3, Mixtral MoE; docs/families.md) trained on the demo data without and
# with JREG (same seed, data and steps), then zeta_L of every checkpoint from eval_jump.
# CPU is fine.
#   OUT=runs/families  TRAIN_ITERS=300  FAMILIES="llama gpt2 qwen3 mixtral"  EVAL_TOKENS=32768 \
#     bash examples/jreg_across_families.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$REPO/runs/families}
export DATA_DIR=${DATA_DIR:-$REPO/runs/demo/data}
FAMILIES=${FAMILIES:-llama gpt2 qwen3 mixtral}
cd "$REPO"
start=$(date +%s)

bash examples/prepare_demo_data.sh
loads=() labels=()
for family in $FAMILIES; do
  preset=$([ "$family" = llama ] && echo tiny || echo "$family-tiny")
  for lambda in 0 1.0; do
    name="$family-$([ "$lambda" = 0 ] && echo baseline || echo jreg)"
    echo "== $name: --model-preset $preset, lambda=$lambda"
    MODEL_PRESET=$preset JREG_LAMBDA=$lambda RUN_DIR="$OUT/$name" \
      TRAIN_ITERS=${TRAIN_ITERS:-300} bash examples/pretrain_tiny_jreg.sh
    loads+=("$OUT/$name/checkpoints") labels+=(--label "$name")
  done
done

echo "== eval_jump on every checkpoint"
python tools/eval_jump.py --load "${loads[@]}" "${labels[@]}" \
  --data-path "$DATA_DIR/demo_text_document" --seq-length 128 --max-tokens "${EVAL_TOKENS:-32768}" --batch-size 16 \
  --json "$OUT/jump.json" --csv "$OUT/jump.csv"

echo "done in $(( $(date +%s) - start ))s: runs under $OUT, zeta per family in $OUT/jump.json"
