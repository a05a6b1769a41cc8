"""Each CPU redirection in megatron_jreg.platform.cpu does what its comment says."""

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def checks():
    script = os.path.join(os.path.dirname(__file__), "cpu_checks.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore",
                                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(
                                       os.path.abspath(__file__))))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("CHECKS ")][-1]
    return json.loads(line[len("CHECKS "):])


def test_cuda_device_requests_land_on_cpu(checks):
    # before activate(): an error (CPU build of torch) or a GPU tensor, never a CPU one
    assert checks["before"]["zeros_cuda"] in ("error", "cuda")
    assert checks["factories"] == ["cpu"] * 18
    assert checks["empty_like"] == ["cpu"] * 3 and checks["sharded_init_data"] == "cpu"
    assert checks["current_device"] == "cpu"
    assert checks["synchronize"] and checks["tensor_cuda_identity"]
    # pin_memory=True is dropped (no pinned allocator without a GPU), so megatron-core's
    # context-parallel RoPE slice runs: rank 1 of 2 holds chunks 1 and 2 of 4
    assert checks["pinned_tensor"] == [1]
    assert checks["cp_rope_chunks"] == [2.0, 3.0, 4.0, 5.0]


def test_optimizer_type_dispatch_sees_cuda_names(checks):
    assert checks["types"] == ["torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor",
                               "torch.cuda.HalfTensor", "torch.float64"]


def test_rng_tracker_is_cpu_and_isolated(checks):
    assert checks["tracker_class"] == "CpuRNGStatesTracker"
    assert checks["default_state_restored"]
    assert checks["fork_stream_advances"]
    assert checks["fork_differs_from_default"]
    assert checks["cuda_rng_state_empty"]


def test_cpu_platform_carries_no_megatron_core_fix(checks):
    """The fixes apply on every device from the model builder; activate() maps devices only
    (megatron-core's own, unfixed behaviour is still visible after it)."""
    assert checks["mcore_fixes_applied"] is False
    assert checks["checkpoint_without_output_fp8"] is True
    assert checks["writer_queue_is_local"] is False


HF_AFTER_ACTIVATE = r"""
import json, sys, torch
from megatron_jreg.platform import cpu
cpu.activate()  # before anything has placed a tensor under `with torch.device(...)`
import transformers
config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=96, rope_theta=5000.0)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
with torch.device("meta"):
    meta = torch.arange(4)  # the wrapped factory, placed by the device mode
print(json.dumps({"inv_freq": model.model.rotary_emb.inv_freq.tolist(), "meta": meta.device.type}))
"""


def test_device_mode_still_places_the_wrapped_factories(tmp_path):
    """A Hugging Face model loaded after activate() (eval_jump --load, then --hf-model in one
    process): transformers builds it under torch.device("meta"), whose mode must still see
    the factories the redirection wraps, else RoPE's inv_freq is uninitialised memory."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", HF_AFTER_ACTIVATE, str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [5000.0 ** (-i / 8) for i in range(0, 8, 2)]  # base^(-2i/d), head dim 8
    assert got["inv_freq"] == pytest.approx(want, rel=1e-6)
    assert got["meta"] == "meta"
