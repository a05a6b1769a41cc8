#!/usr/bin/env python
"""Export a checkpoint of our trainer to a Hugging Face LlamaForCausalLM directory.

    python tools/convert_to_hf.py --load CKPT [--iteration N] --output DIR

Any TP/PP layout is read on one process. The mapping and the checks live in
``megatron_jreg.analysis.hf_export``; usage with lm_eval: docs/evaluation.md.
"""

import sys

from megatron_jreg.analysis.hf_export import main

if __name__ == "__main__":
    sys.exit(main())
