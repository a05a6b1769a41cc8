"""Train a small Llama-2-style sentencepiece model on a local corpus (no download).

    python tools/train_tokenizer.py --input demo.jsonl --model-prefix tok --vocab-size 3000
"""

import sys

from megatron_jreg.commands.exit_codes import OK, run_command
from megatron_jreg.commands.flags import tool_values
from megatron_jreg.data.tokenizers.training import TrainTokenizerConfig, train_tokenizer


def main(argv=None) -> int:
    values = tool_values({None: TrainTokenizerConfig}, argv, description=__doc__.splitlines()[0])
    # megatron_jreg.errors.InputError is a ValueError; sentencepiece raises plain ones too
    return run_command(lambda: _train(values[None]), also=(ValueError, FileNotFoundError))


def _train(values: dict) -> int:
    config = TrainTokenizerConfig(**values)
    trained = train_tokenizer(config)
    print(trained.summary(config))
    return OK


if __name__ == "__main__":
    sys.exit(main())
