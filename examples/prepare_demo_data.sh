#!/usr/bin/env bash
# Build the built-in demo corpus (English docstrings of the Python standard library, no
# download), a 2000-piece sentencepiece tokenizer and the indexed dataset. Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR=${DATA_DIR:-$REPO/runs/demo/data}
mkdir -p "$DATA_DIR"
cd "$REPO"
[ -f "$DATA_DIR/corpus.jsonl" ] || python tools/make_demo_corpus.py --output "$DATA_DIR/corpus.jsonl"
[ -f "$DATA_DIR/tokenizer.model" ] || python tools/train_tokenizer.py --input "$DATA_DIR/corpus.jsonl" \
  --model-prefix "$DATA_DIR/tokenizer" --vocab-size 2000
[ -f "$DATA_DIR/demo_text_document.idx" ] || python tools/preprocess_data.py \
  --input "$DATA_DIR/corpus.jsonl" --output-prefix "$DATA_DIR/demo" \
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$DATA_DIR/tokenizer.model" \
  --workers 2 --append-eod
