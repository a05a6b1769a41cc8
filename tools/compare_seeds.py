#!/usr/bin/env python
"""Is JREG better than the baseline across seeds? One-sided t-test on paired differences."""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.compare_seeds import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
