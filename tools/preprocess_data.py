"""Tokenise raw text into megatron-core .bin/.idx datasets (Megatron-LM's flags).

    python tools/preprocess_data.py --input DATA.jsonl --output-prefix OUT \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model \\
        --workers 8 --append-eod
"""

import sys

from megatron_jreg.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
