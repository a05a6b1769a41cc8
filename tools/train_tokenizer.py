"""Train a small Llama-2-style sentencepiece model on a local corpus (no download).

    python tools/train_tokenizer.py --input demo.jsonl --model-prefix tok --vocab-size 3000
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.cli import ArgumentParser  # noqa: E402
from megatron_jreg.data.tokenizer_training import TrainTokenizerConfig, train_sentencepiece  # noqa: E402


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="JSONL/text files, globs or directories")
    p.add_argument("--model-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    p.add_argument("--vocab-size", type=int, default=3000)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--input-format", choices=("jsonl", "text"), default="jsonl")
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--max-sentences", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    try:
        config = TrainTokenizerConfig(**vars(args))
        path = train_sentencepiece(config)
    except (ValueError, FileNotFoundError) as e:  # megatron_jreg.errors.InputError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} (vocab {config.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
