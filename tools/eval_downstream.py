#!/usr/bin/env python
"""Downstream accuracy (the paper's Table 3) through lm-evaluation-harness, offline-capable."""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.eval_downstream import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
