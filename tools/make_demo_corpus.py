"""Write a deterministic demo JSONL corpus of English docstrings from the Python stdlib.

    python tools/make_demo_corpus.py --output demo.jsonl --max-mb 4
    python tools/make_demo_corpus.py --chat --output chat.jsonl   # conversations for --sft
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.commands.flags import tool_values  # noqa: E402
from megatron_jreg.data.demo_corpus import DemoCorpusConfig, write_demo_corpus  # noqa: E402


def main(argv=None) -> int:
    values = tool_values({None: DemoCorpusConfig}, argv, description=__doc__.splitlines()[0])
    try:
        config = DemoCorpusConfig(**values[None])
        docs, nbytes = write_demo_corpus(config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "conversations" if config.chat else "documents"
    print(f"wrote {docs} {what} ({nbytes / 1e6:.2f} MB) to {config.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
