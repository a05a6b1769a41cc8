#!/usr/bin/env bash
# Supervised fine-tuning of the 3.4B baseline and JREG models, the paper's Sec. 5.3 recipe:
# the Tulu-v1 SFT mixture, lr 2e-5 with a linear schedule, AdamW (0.9, 0.95), global batch
# 512, 957 steps. Ours: no warm-up and no weight decay (the paper gives neither), the
# pretraining layout (TP=2 with sequence parallelism x DP=4 on 8 GPUs), bf16, the
# distributed optimizer with the pretraining recipe's overlap, sequence length 2048. Then the
# jump of both (Table 7).
#
#   SFT_DATA_PATH=/data/tulu_v1_sft_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#   BASELINE_CKPT=runs/3b_lambda0_alpha1.0/checkpoints JREG_CKPT=runs/3b_lambda1.0_alpha1.0/checkpoints \
#   EVAL_DATA_PATH=/data/fineweb_edu_text_document bash examples/sft_3b.sh
#
# SFT_DATA_PATH: from `tools/preprocess_data.py --sft` on the mixture's JSONL. Re-running the
# same command after a crash or preemption resumes each fine-tuning run from its own
# checkpoints (--load), not from the pretrained weights again.
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
: "${SFT_DATA_PATH:?set SFT_DATA_PATH to the prefix written by tools/preprocess_data.py --sft}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer the data was made with}"
: "${BASELINE_CKPT:?set BASELINE_CKPT to the baseline pretraining run's checkpoints}"
: "${JREG_CKPT:?set JREG_CKPT to the JREG pretraining run's checkpoints}"
OUT=${OUT:-$REPO/runs/sft_3b}
cd "$REPO"

for name in baseline jreg; do
  pretrained=$BASELINE_CKPT
  [ "$name" = jreg ] && pretrained=$JREG_CKPT
  run="$OUT/$name"
  # shellcheck disable=SC2046
  run_trainer --sft --model-preset 3b --seq-length 2048 \
    --pretrained-checkpoint "$pretrained" --finetune \
    --tensor-model-parallel-size 2 --sequence-parallel \
    --micro-batch-size "${MICRO_BATCH_SIZE:-4}" --global-batch-size 512 --train-iters 957 \
    --lr 2e-5 --min-lr 0 --lr-warmup-iters 0 --lr-decay-style linear \
    --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0 --clip-grad 1.0 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --transformer-impl "${TRANSFORMER_IMPL:-auto}" \
    --data-path "$SFT_DATA_PATH" --split 99,1,0 \
    --tokenizer-type "${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}" --tokenizer-model "$TOKENIZER_MODEL" \
    --jreg-lambda "${SFT_JREG_LAMBDA:-0}" \
    --save "$run/checkpoints" --save-interval 200 $(load_args "$run/checkpoints") \
    --eval-interval 200 --eval-iters 10 --log-interval 10 \
    --tensorboard-dir "$run/tensorboard" --metrics-file "$run/metrics.jsonl"
done

if [ -n "${EVAL_DATA_PATH:-}" ]; then
  # the jump after SFT, measured on pretraining-style text (Table 7)
  python tools/eval_jump.py --load "$OUT/baseline/checkpoints" "$OUT/jreg/checkpoints" \
    --label baseline-sft --label jreg-sft --data-path "$EVAL_DATA_PATH" --seq-length 2048 \
    --device cuda --dtype bfloat16 --max-tokens 1048576 --batch-size 8 \
    --json "$OUT/sft_jump.json" --csv "$OUT/sft_jump.csv"
fi
