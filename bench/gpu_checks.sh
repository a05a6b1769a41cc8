#!/usr/bin/env bash
# One prepared run for a machine with a GPU, sized for one 10-minute command:
#   preflight    a line per requirement (interpreter: python, else python3; pip; every
#                import of the checks; the kernel; nvcc's version; the GPU's name and
#                memory); one missing stops the run (exit 2) with the fix, before any
#                long step
#   install      the kernel build (pip install --no-build-isolation --no-deps -e .), at
#                most 100 s (INSTALL_TIMEOUT); skipped when the kernel is already built
#   checks       bench/gpu_checks.py; its checks' limits add up to at most 480 s
#                (LIMITS_S there; `python3 bench/gpu_checks.py --help` lists them); a check
#                past its limit is killed with its whole process group
# The checks: the fused kernel's error against float64 per dtype, the GPU-marked tests,
# the trainer's save and resume against an uninterrupted run, save/load time and size per
# checkpoint format (plain, fully parallel, async), the op's bandwidth against
# the GPU's peak, JREG's step overhead at 170m, the 3B script's model flags at 2 layers
# (local spec and Transformer Engine when installed), tokens/s and MFU at 1b (SDPA and TE
# attention, JREG off and on).
# Written: each check's row is appended to $OUT/gpu_checks.jsonl (bench/gpu_checks.jsonl
# without $OUT) as it finishes, so a cut run keeps the finished ones; one summary table at
# the end; exit 1 if a check failed. Arguments go to gpu_checks.py (--device cpu: the CPU
# plan; --quick: toy sizes; --only TEXT...), except --install-only: preflight and install,
# then stop (for a build slower than 100 s: `INSTALL_TIMEOUT=500 bash bench/gpu_checks.sh
# --install-only` in one command, the checks in the next).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
INSTALL_ONLY=0
args=()
prev=""
for arg in "$@"; do
  case "$arg" in
    --install-only) INSTALL_ONLY=1; prev="$arg"; continue ;;
    --device=*) DEVICE="${arg#--device=}" ;;
  esac
  [ "$prev" = "--device" ] && DEVICE="$arg"
  args+=("$arg")
  prev="$arg"
done
PY="$(command -v python || command -v python3 || true)"
if [ -z "$PY" ]; then
  echo "preflight: interpreter: MISSING: neither python nor python3 on PATH; fix: install Python 3 or add it to PATH"
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package, installed or not
"$PY" bench/gpu_checks.py --device "$DEVICE" --preflight-only
# torch first: the extension links against it
if "$PY" -c "import sys, torch, megatron_jreg._C as c; sys.exit(0 if '$DEVICE' == 'cpu' or c.cuda_built() else 1)" 2>/dev/null; then
  echo "install: the kernel is already built for $DEVICE; skipped"
else
  limit=${INSTALL_TIMEOUT:-100}
  echo "install: building the kernel ($PY -m pip install --no-build-isolation --no-deps -e .; at most $limit s)"
  t0=$SECONDS
  if ! timeout "$limit" "$PY" -m pip install -q --no-build-isolation --no-deps -e .; then
    echo "install: FAILED or past $limit s (see above); fix: the build needs a C++ compiler, nvcc" \
         "(CUDA_HOME) and the CUDA build of torch; a slow build: INSTALL_TIMEOUT=500 bash bench/gpu_checks.sh --install-only"
    exit 2
  fi
  "$PY" -c "import torch, megatron_jreg._C as c; print('install: done in $((SECONDS - t0)) s; CUDA kernel built:', c.cuda_built())"
fi
[ "$INSTALL_ONLY" = 1 ] && exit 0
if [[ " ${args[*]-} " != *" --device"* ]]; then args=(--device "$DEVICE" "${args[@]}"); fi
# its preflight prints only a missing requirement: the lines above are the full one
exec "$PY" bench/gpu_checks.py --quiet-preflight "${args[@]}"
