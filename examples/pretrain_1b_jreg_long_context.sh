#!/usr/bin/env bash
# 1B Llama with JREG at 32k-token sequences: pretrain_1b_jreg.sh's model, JREG settings and
# recipe (run_paper_recipe in launch_common.sh; at 2^19 tokens per step: 16 sequences of
# 32768, 200K steps, 105B tokens) with each sequence split over 4 GPUs by context
# parallelism: one 8-GPU node holds CP 4 x DP 2. Sizes and layout below are ours.
#
# Memory per GPU at micro-batch 1, bf16, no recomputation (each GPU holds 32768 / 4 = 8192
# tokens): weights 2 B + fp32 gradients 4 B per parameter, and the distributed optimizer's
# 12 B (fp32 copy, Adam moments) split over DP x CP = 8: 0.95B x 7.5 B = 7 GB; activations
# about 31 x hidden bytes per token per layer (norm and linear inputs, q/k/v, the SwiGLU's
# 2 x 5632 + 5632; flash attention keeps no 32k x 32k scores): 8192 x 16 x 64 KB = 8.5 GB;
# logits 8192 x 32000 in bf16 and fp32 for the loss, with its gradient: 2.5 GB; without
# Transformer Engine the gathered keys and values, 16 x 128 MB = 2 GB. About 20 GB of 80.
# One GPU per sequence (CP 1) would need about 50 GB: it fits, with no room for a longer
# context. CP 4 leaves SEQ_LENGTH=65536 (about 35 GB) to the same layout without recompute;
# TP would split 2048-wide matrices into GEMMs too small for the GPU, so TP stays 1.
# --rotary-base 500000: Llama 3's RoPE base (the 1b preset's is 10000), chosen there for long contexts.
#
#   DATA_PATH=/data/fineweb_edu_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#     bash examples/pretrain_1b_jreg_long_context.sh
#   JREG_LAMBDA=0 ... (or pretrain_1b_baseline_long_context.sh) gives the baseline twin;
#   SEQ_LENGTH=65536 a longer context; the other variables as in launch_common.sh.
SEQ_LENGTH=${SEQ_LENGTH:-32768}
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
run_paper_recipe 1b \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 4 \
  --max-position-embeddings "$SEQ_LENGTH" --rotary-base 500000 \
  --micro-batch-size 1 --lr 4e-4 --min-lr 4e-5
