#!/usr/bin/env bash
# 3.4B Llama with JREG, the paper's main run (paper: 8x H200, 159 h).
# Ours: 8x H100/H200 as TP=2 with sequence parallelism x DP=4, bf16, distributed optimizer
# (its communication overlapped with compute),
# no recompute (add EXTRA_ARGS="--recompute-granularity selective" if memory runs short).
# The recipe shared with 170m and 1b (batch, schedule, optimizer: ours) is
# run_paper_recipe in launch_common.sh. Micro-batch and learning rate below are ours too.
#
#   DATA_PATH=/data/fineweb_edu_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#     bash examples/pretrain_3b_jreg.sh
#   JREG_LAMBDA=0 ... gives the baseline twin; NNODES/NODE_RANK/MASTER_ADDR for multi-node.
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
run_paper_recipe 3b \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel \
  --micro-batch-size 4 --lr 3e-4 --min-lr 3e-5
