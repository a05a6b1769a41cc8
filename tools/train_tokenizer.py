"""Train a small Llama-2-style sentencepiece model on a local corpus (no download).

    python tools/train_tokenizer.py --input demo.jsonl --model-prefix tok --vocab-size 3000
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.flags import tool_values  # noqa: E402
from megatron_jreg.data.tokenizer_training import TrainTokenizerConfig, train_tokenizer  # noqa: E402


def main(argv=None) -> int:
    values = tool_values({None: TrainTokenizerConfig}, argv, description=__doc__.splitlines()[0])
    try:
        config = TrainTokenizerConfig(**values[None])
        trained = train_tokenizer(config)
    except (ValueError, FileNotFoundError) as e:  # megatron_jreg.errors.InputError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(trained.summary(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
