#!/usr/bin/env python
"""Measure the final-layer jump of a model: Psi_l per layer and zeta_L, zeta_{L-1}, zeta_{L-2}.

    python tools/eval_jump.py --hf-model DIR --text-file eval.txt --json out.json
    python tools/eval_jump.py --load CKPT --all-iterations --text-file eval.txt --plot traj.png
    torchrun --nproc_per_node 4 tools/eval_jump.py --load CKPT --tensor-model-parallel-size 2 \
        --text-file eval.txt --json out.json        # TP2 x DP2

Options and the report format: ``--help`` and docs/evaluation.md. The logic lives in
``megatron_jreg.analysis``; model kinds plug in through
``megatron_jreg.analysis.source_kinds``.
"""

import os
import sys

# Run from a checkout, use that checkout's package (as Megatron-LM's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.analysis.eval_jump_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
