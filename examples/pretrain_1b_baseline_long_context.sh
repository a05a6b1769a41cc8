#!/usr/bin/env bash
# The baseline twin of pretrain_1b_jreg_long_context.sh: identical run with lambda = 0 (the
# displacement is still measured and logged).
JREG_LAMBDA=0 exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_1b_jreg_long_context.sh"
