"""Write a deterministic demo JSONL corpus of English docstrings from the Python stdlib.

    python tools/make_demo_corpus.py --output demo.jsonl --max-mb 4
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.cli import ArgumentParser  # noqa: E402
from megatron_jreg.data.demo_corpus import DemoCorpusConfig, write_demo_corpus  # noqa: E402


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="the JSONL file to write")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--max-mb", type=float, default=None, help="stop after this many MB")
    p.add_argument("--min-chars", type=int, default=200, help="drop shorter docstrings")
    args = p.parse_args(argv)
    try:
        docs, nbytes = write_demo_corpus(DemoCorpusConfig(**vars(args)))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {docs} documents ({nbytes / 1e6:.2f} MB) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
