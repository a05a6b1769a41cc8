"""Each megatron-core workaround of megatron_jreg.platform.mcore_fixes, before and after it
is applied (tests/platform/mcore_fix_checks.py, in a fresh process)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def checks():
    script = os.path.join(REPO, "tests", "platform", "mcore_fix_checks.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("CHECKS ")][-1]
    return json.loads(line[len("CHECKS "):])


def test_selective_recompute_without_te(checks):
    assert checks["fp8_before"] is True  # megatron-core 0.16.1: fp8 = (fp8 is not None)
    assert checks["recompute_before"].startswith("NameError")
    assert checks["fp8_after"] is False
    assert checks["recompute_after_equals_norm"]


def test_checkpoint_writer_queue_is_in_process(checks):
    assert checks["queue_before"] == "None"  # built lazily as a Manager().Queue() otherwise
    assert checks["queue_after_is_local"] and checks["queue_round_trip"]
    assert checks["child_processes_after_save"] == 0


def test_distributed_optimizer_checkpoints_with_torch_adam(checks):
    assert checks["fresh_state_dict_before"] == "AssertionError"
    assert checks["fresh_state_dict_after_step"] == [0, 0]
    assert checks["loaded_steps"] == [3.0]
    assert checks["step_tensors_distinct"]
    assert checks["resumed_step_matches"]


def test_moe_router_without_te(checks):
    assert checks["router_before"].startswith("NameError")
    assert "te_general_gemm" in checks["router_before"]
    assert checks["router_after_equals_mm"] and checks["router_grad_equals_mm"]


def test_every_fix_is_applied_by_the_model_builder():
    """build_model applies them on any device; nothing about them lives in platform/cpu.py."""
    import inspect

    from megatron_jreg.model import builder
    from megatron_jreg.platform import cpu, mcore_fixes

    assert "mcore_fixes.apply()" in inspect.getsource(builder.build_model)
    source = inspect.getsource(cpu)
    for fix in mcore_fixes.FIXES:
        assert fix.__name__ not in source
    for name in ("CheckpointWithoutOutput", "WrappedTorchNorm", "DistributedOptimizer",
                 "filesystem_async"):
        assert name not in source.split('"""', 2)[2], name  # code, not the docstring
