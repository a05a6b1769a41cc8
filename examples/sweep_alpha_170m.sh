#!/usr/bin/env bash
# The paper's alpha sweep at 170M: lambda = 1 with alpha in {0, 0.1, 0.3, 0.5, 1, 3}, plus
# the baseline. Runs one after another on this node; each run resumes if restarted.
set -euo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
JREG_LAMBDA=0 bash "$HERE/pretrain_170m_jreg.sh"
for alpha in ${ALPHAS:-0 0.1 0.3 0.5 1 3}; do
  JREG_LAMBDA=1.0 JREG_ALPHA=$alpha bash "$HERE/pretrain_170m_jreg.sh"
done
