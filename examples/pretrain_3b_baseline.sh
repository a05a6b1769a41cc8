#!/usr/bin/env bash
# The baseline twin of pretrain_3b_jreg.sh: identical run with lambda = 0 (the
# displacement is still measured and logged).
JREG_LAMBDA=0 exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_3b_jreg.sh"
