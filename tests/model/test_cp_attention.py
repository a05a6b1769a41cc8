"""Context-parallel attention (model/context_parallel.py) equals full-sequence SDPA: the
output and the gradients of q, k and v of each rank's chunks, for causal attention, GQA
and GQA with padded keys, at CP 2 and CP 4 over gloo (float64: equal to rounding)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(__file__), "cp_attention_worker.py")


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_attention_equals_full_sequence_sdpa(tmp_path, cp_size):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(cp_size), WORKER, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in range(cp_size):
        with open(tmp_path / f"rank_{rank}.json") as f:
            result = json.load(f)
        assert set(result) == {"causal", "gqa", "gqa_padding"}
        for case, diffs in result.items():
            assert diffs.pop("finite"), (rank, case)
            for what, diff in diffs.items():
                assert diff < 1e-12, (cp_size, rank, case, what, diff)
