"""Tokenise raw text into megatron-core .bin/.idx datasets (Megatron-LM's flags).

    python tools/preprocess_data.py --input DATA.jsonl --output-prefix OUT \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --workers 8 --append-eod
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.data.preprocess.pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
