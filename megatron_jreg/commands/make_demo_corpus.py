"""Write a deterministic demo JSONL corpus of English docstrings from the Python stdlib.

    python tools/make_demo_corpus.py --output demo.jsonl --max-mb 4
    python tools/make_demo_corpus.py --chat --output chat.jsonl   # conversations for --sft
"""

import sys

from megatron_jreg.commands.exit_codes import OK, run_command
from megatron_jreg.commands.flags import tool_values
from megatron_jreg.data.preprocess.demo_corpus import DemoCorpusConfig, write_demo_corpus


def main(argv=None) -> int:
    values = tool_values({None: DemoCorpusConfig}, argv, description=__doc__.splitlines()[0])
    return run_command(lambda: _write(values[None]), also=(ValueError, FileNotFoundError))


def _write(values: dict) -> int:
    config = DemoCorpusConfig(**values)
    docs, nbytes = write_demo_corpus(config)
    what = "conversations" if config.chat else "documents"
    print(f"wrote {docs} {what} ({nbytes / 1e6:.2f} MB) to {config.output}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
