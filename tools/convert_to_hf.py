#!/usr/bin/env python
"""Export a checkpoint of our trainer to a Hugging Face LlamaForCausalLM directory."""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.convert_to_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
