#!/usr/bin/env python
"""Convert a Hugging Face causal LM into a megatron-jreg checkpoint.

    python tools/convert_from_hf.py --hf-model DIR --save CKPT

Runs on one process; the mapping and the checks live in
``megatron_jreg.checkpoint.hf_import``; see docs/families.md.
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.checkpoint.hf_import import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
