"""Tokenise raw text into megatron-core .bin/.idx datasets (Megatron-LM's flags)."""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
