"""The GPU arm of every place that still branches on the device (docs/design.md, "Where the
code branches on the device"), run on the CPU: torch's CUDA entry points are replaced by
recorders, so each test sees what the GPU arm calls and returns, with no GPU."""

import importlib
import os

import pytest
import torch
import torch.distributed as dist

from megatron_jreg.analysis.devices import resolve_device
from megatron_jreg.checkpoint import dist_checkpoint, model_loader
from megatron_jreg.distributed import setup
from megatron_jreg.errors import InputError
from megatron_jreg.platform import cpu as cpu_platform
from megatron_jreg.platform import device
from megatron_jreg.training.metrics import memory_gib

# the module (the package's ``displacement`` is the layer-mean function of the same name)
displacement = importlib.import_module("megatron_jreg.ops.displacement")


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda as a GPU machine with two devices shows it; records set_device."""
    calls = {"set_device": []}
    current = {"index": 0}

    def set_device(dev):
        index = dev.index if isinstance(dev, torch.device) else int(dev)
        calls["set_device"].append(index)
        current["index"] = index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.delenv("MEGATRON_JREG_DEVICE", raising=False)
    return calls


def test_the_mapping_on_a_gpu(fake_gpu):
    assert device.use_cpu() is False
    assert device.device_type() == "cuda" and device.backend() == "nccl"
    assert device.current_device() == torch.device("cuda", 0)


def test_the_mapping_on_a_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MEGATRON_JREG_DEVICE", "cpu")  # a GPU machine pinned to the CPU
    assert (device.device_type(), device.backend(), device.current_device()) == (
        "cpu", "gloo", torch.device("cpu"))


def test_initialize_distributed_gpu_arm(fake_gpu, monkeypatch):
    """A GPU run: its LOCAL_RANK's GPU, NCCL, and the CPU redirection never activated."""
    started = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: started.append(kw))
    monkeypatch.setattr(cpu_platform, "activate",
                        lambda: pytest.fail("the CPU redirection ran on a GPU"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)
    setup.initialize_distributed(timeout_minutes=3)
    assert fake_gpu["set_device"] == [1]
    [kwargs] = started
    assert kwargs["backend"] == "nccl" and kwargs["world_size"] == 1
    monkeypatch.setenv("RANK", "0")  # under torchrun: the launcher's rendezvous
    setup.initialize_distributed(timeout_minutes=3)
    assert started[1] == {"backend": "nccl", "timeout": started[1]["timeout"]}


def test_init_world_gpu_arm(fake_gpu, monkeypatch):
    """eval_jump/convert --device cuda[:N]: the named GPU, or LOCAL_RANK's under torchrun."""
    monkeypatch.setattr(setup, "initialize_distributed", lambda *a, **k: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert model_loader.init_world("cuda:1") == torch.device("cuda", 1)
    assert fake_gpu["set_device"] == [1]
    assert "MEGATRON_JREG_DEVICE" not in os.environ  # the CPU pin is for --device cpu only
    assert model_loader.init_world("cuda") == torch.device("cuda", 1)  # the current GPU
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="under torchrun give --device cuda"):
        model_loader.init_world("cuda:1")


def test_resolve_device_gpu_arm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="CUDA is not available here; use --device cpu"):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_rng_state_gpu_arm(monkeypatch):
    """A checkpoint of a GPU run carries the CUDA generator's state, and a resume sets it."""
    saved_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    state = dist_checkpoint._rng_state()
    assert torch.equal(state["cuda"], saved_state)
    dist_checkpoint._set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], saved_state)
    # the CPU arm: nothing of CUDA saved, nothing set
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    cpu_state = dist_checkpoint._rng_state()
    assert "cuda" not in cpu_state
    dist_checkpoint._set_rng_state(cpu_state)
    assert len(restored) == 1


def test_memory_gib_gpu_arm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    assert memory_gib(torch.device("cuda", 0)) == 3.0
    import psutil

    rss = psutil.Process().memory_info().rss / 2**30
    assert abs(memory_gib(torch.device("cpu")) - rss) < 0.5  # the CPU arm: resident memory


def test_kernel_dispatch_gpu_arm(monkeypatch):
    """The trainer's start-up line for a run on a GPU: the CUDA kernel where it was built,
    else the reference and why the install built none (the reason compiled into _C)."""
    from megatron_jreg import _C

    if torch.version.cuda is None:  # this install: a CPU torch left CUDA out, and _C says why
        assert _C.CUDA_SKIPPED == 2
        assert displacement.kernel_build() == "built for CPU only (torch was a CPU build at install)"
    monkeypatch.setattr(displacement, "_CUDA_BUILT", True)
    assert displacement.fused_available("cuda")
    assert displacement.describe_impl("auto", "cuda") == ("fused", "the CUDA kernel, --jreg-impl auto")
    monkeypatch.setattr(displacement, "_CUDA_BUILT", False)
    assert not displacement.fused_available("cuda")
    monkeypatch.setattr(_C, "CUDA_SKIPPED", 3)
    impl, why = displacement.describe_impl("auto", "cuda")
    assert impl == "torch"
    assert "no fused kernel for cuda" in why and "nvcc was missing at install" in why
    # the CPU arm
    assert displacement.describe_impl("auto", "cpu") == ("fused", "the C++/OpenMP kernel, --jreg-impl auto")
    assert displacement.describe_impl("torch", "cuda")[0] == "torch"


def test_sdpa_reads_groups_gpu_arm(monkeypatch):
    """On a GPU, grouped K/V go to SDPA unexpanded only where PyTorch's own check says
    FlashAttention runs them (elsewhere enable_gqa would leave only the math kernel)."""
    from types import SimpleNamespace

    from megatron_jreg.model.attention import sdpa_reads_groups

    asked = []
    verdict = {"flash_enabled": True, "flash_runs": True}

    def sdpa_params(*args):
        asked.append(args)
        return args

    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: verdict["flash_enabled"])
    monkeypatch.setattr(torch.backends.cuda, "SDPAParams", sdpa_params)
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention",
                        lambda params: verdict["flash_runs"])
    q, k, v = (SimpleNamespace(device=torch.device("cuda", 0)) for _ in range(3))
    assert sdpa_reads_groups(q, k, v, None, 0.0, True) is True
    assert asked == [(q, k, v, None, 0.0, True, True)]  # enable_gqa asked of the check
    verdict["flash_runs"] = False  # e.g. fp32 or an explicit mask: K/V are expanded
    assert sdpa_reads_groups(q, k, v, None, 0.0, True) is False
    verdict.update(flash_enabled=False, flash_runs=True)  # FlashAttention turned off
    assert sdpa_reads_groups(q, k, v, None, 0.0, True) is False
