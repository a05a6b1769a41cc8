#!/usr/bin/env python
"""Export a checkpoint of our trainer to a Hugging Face LlamaForCausalLM directory.

    python tools/convert_to_hf.py --load CKPT [--iteration N] --output DIR

Any TP/PP layout is read on one process. The mapping and the checks live in
``megatron_jreg.checkpoint.hf_export``; usage with lm_eval: docs/evaluation.md.
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.checkpoint.hf_export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
