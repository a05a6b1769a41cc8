#!/usr/bin/env bash
# 170M Llama with JREG (paper: 4x H100, 16 h).
# Ours: one node of 8 GPUs, data parallel only (the model fits on one GPU); the recipe
# shared with 1b and 3b (batch, schedule, optimizer: ours) is run_paper_recipe in
# launch_common.sh. Micro-batch and learning rate below are ours too.
#
#   DATA_PATH=/data/fineweb_edu_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#     bash examples/pretrain_170m_jreg.sh
#   JREG_LAMBDA=0 ... gives the baseline twin; NNODES/NODE_RANK/MASTER_ADDR for multi-node.
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
run_paper_recipe 170m \
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
  --micro-batch-size 16 --lr 6e-4 --min-lr 6e-5
