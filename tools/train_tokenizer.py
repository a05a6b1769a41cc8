"""Train a small Llama-2-style sentencepiece model on a local corpus (no download)."""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
