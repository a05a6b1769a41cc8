#!/usr/bin/env python
"""Measure the final-layer jump of a model: Psi_l per layer and zeta_L, zeta_{L-1}, zeta_{L-2}."""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.eval_jump import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
