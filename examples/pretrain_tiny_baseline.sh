#!/usr/bin/env bash
# The baseline twin of pretrain_tiny_jreg.sh (lambda = 0).
JREG_LAMBDA=0 exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_tiny_jreg.sh"
