#!/usr/bin/env bash
# One prepared run for a machine with a GPU: build with the CUDA kernel, run the GPU-marked
# tests, then the GPU benchmarks (op time and bandwidth at [2048, 4, 3072] bf16; step time
# and memory of a training step at the 170m preset's dimensions, JREG off / fused / torch).
# Prints everything; writes nothing outside the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
pip install -q --no-build-isolation -e ".[test]"
python -c "import torch, megatron_jreg._C as c; print('CUDA kernel built:', c.cuda_built())"
python -m pytest -q -m gpu tests/ops
python bench/displacement_op.py --device cuda --dtype bf16
python bench/jreg_overhead.py --device cuda --layers 12 --hidden 768 --seq 2048 --micro-batch 8 --vocab 32000
