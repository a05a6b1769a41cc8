#!/usr/bin/env bash
# One prepared run for a machine with a GPU (about 8 minutes on one H200): install with the
# CUDA kernel, then bench/gpu_checks.py: the GPU-marked tests, the op's bandwidth against
# the GPU's peak, JREG's step overhead at 170m, the 3B script's model flags at 2 layers
# (local spec and Transformer Engine when installed; bf16, selective recompute of
# layernorm), tokens/s and MFU at 170m. Ends with one summary table; exit 1 if a check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
pip install -q --no-build-isolation --no-deps -e .
python -c "import torch, megatron_jreg._C as c; print('CUDA kernel built:', c.cuda_built())"
python bench/gpu_checks.py --device cuda "$@"
