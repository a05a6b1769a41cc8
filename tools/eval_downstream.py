#!/usr/bin/env python
"""Downstream accuracy (the paper's Table 3) through lm-evaluation-harness, offline-capable.

    python tools/eval_downstream.py --load runs/jreg-s1/ckpt runs/jreg-s2/ckpt --tasks paper \
        --json jreg.json
    python tools/eval_downstream.py --hf-model DIR --tasks boolq,piqa --include-path tasks/

Options, metrics and the report: ``--help`` and docs/evaluation.md. The logic lives in
``megatron_jreg.downstream``.
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.downstream.eval_downstream_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
