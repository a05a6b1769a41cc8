"""The GPU arm of every place that still branches on the device (docs/design.md, "Where the
code branches on the device"), run on the CPU: torch's CUDA entry points are replaced by
recorders, so each test sees what the GPU arm calls and returns, with no GPU."""

import importlib
import os

import pytest
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from megatron_jreg.checkpoint import model_loader, rng_state
from megatron_jreg.distributed import setup
from megatron_jreg.errors import InputError
from megatron_jreg.platform import cpu as cpu_platform
from megatron_jreg.platform import device
from megatron_jreg.platform.device import peak_memory_gib as memory_gib
from megatron_jreg.platform.device import resolve_device

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
    """eval_jump/convert --device cuda[:N]: the named GPU, or LOCAL_RANK's under torchrun;
    the process group starts on the named GPU (GPU 0 is never set first)."""
    started = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: started.append(kw))
    monkeypatch.setattr(model_loader.atexit, "register", lambda fn: None)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert model_loader.init_world("cuda:1") == torch.device("cuda", 1)
    assert fake_gpu["set_device"] == [1, 1] and started[0]["backend"] == "nccl"
    assert "MEGATRON_JREG_DEVICE" not in os.environ  # the CPU pin is for --device cpu only
    assert model_loader.init_world("cuda") == torch.device("cuda", 1)  # the current GPU
    assert len(started) == 1
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


def test_rng_state_gpu_arm(fake_gpu, monkeypatch):
    """A checkpoint of a GPU run carries the CUDA generator's state, and a resume on a GPU
    sets it with the tracker's streams."""
    saved_state = torch.arange(16, dtype=torch.uint8)
    restored, tracker_set = [], []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    tracker = get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "set_states", tracker_set.append)
    state = rng_state.rng_state()
    assert state["jreg_device"] == "cuda" and torch.equal(state["cuda_rng_state"], saved_state)
    rng_state.set_rng_state(state, pytest.fail)  # the same device: nothing to report
    assert len(restored) == 1 and torch.equal(restored[0], saved_state)
    assert tracker_set == [state["rng_tracker_states"]]


def _philox(seed: int, offset: int = 0) -> list:
    """A CUDA generator state read back as torch lays it out: (seed, offset), int64 each."""
    return [seed, offset]


def test_cpu_save_carries_the_cuda_form_of_its_seeds(monkeypatch):
    """A CPU run's checkpoint holds, under Megatron-LM's names, the CUDA generator and the
    tracker's streams as megatron-core's seeding leaves them on a GPU before any draw (seed
    = --seed for the generator and the data-parallel stream, --seed + 2718 + TP rank for the
    model-parallel one, --seed + 1024 + 100 EP rank + expert-TP rank for the experts'), in
    the 16-byte form torch.cuda.set_rng_state takes; its CPU streams go beside them."""
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setenv("MEGATRON_JREG_DEVICE", "cpu")
    cpu_platform.activate()  # a CPU run's tracker
    seed = 4321
    mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=1, ep_rank=2, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    cpu_streams = {name: s.clone() for name, s in tracker.get_states().items()}
    saved = rng_state.rng_state()
    assert saved["jreg_device"] == "cpu"
    expected = {"data-parallel-rng": seed, "model-parallel-rng": seed + 2718 + 1,
                "expert-parallel-rng": seed + 1024 + 100 * 2 + 0}
    assert saved["cuda_rng_state"].dtype == torch.uint8
    assert saved["cuda_rng_state"].view(torch.int64).tolist() == _philox(seed)
    assert {name: s.view(torch.int64).tolist()
            for name, s in saved["rng_tracker_states"].items()} == {
        name: _philox(value) for name, value in expected.items()}
    kept = saved[rng_state.CPU_STREAMS_KEY]
    assert kept.keys() == cpu_streams.keys()
    assert all(torch.equal(kept[name], cpu_streams[name]) for name in kept)
    assert rng_state.saved_device(saved) == "cpu"  # recorded; its CUDA entries do not decide


def test_rng_state_across_devices(fake_gpu, monkeypatch):
    """A CPU save resumed on a GPU sets the CUDA form of the saved seeds with the calls
    Megatron-LM makes (torch.cuda.set_rng_state, the tracker's set_states) and says so once;
    resumed on a CPU it continues the CPU streams. A GPU save resumed on a CPU keeps this
    run's streams (a CUDA state set into a CPU generator raised at the first dropout)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker_set, reports, cuda_set = [], [], []
    monkeypatch.setattr(get_cuda_rng_tracker(), "set_states", tracker_set.append)
    monkeypatch.setattr(torch.cuda, "set_rng_state", cuda_set.append)
    monkeypatch.setenv("MEGATRON_JREG_DEVICE", "cpu")
    cpu_platform.activate()  # a CPU run's tracker
    mrandom.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    torch.manual_seed(5)
    saved_on_cpu = rng_state.rng_state()
    expected = torch.rand(3)
    monkeypatch.delenv("MEGATRON_JREG_DEVICE")  # the resume runs on the (fake) GPU
    rng_state.set_rng_state(saved_on_cpu, reports.append, "ckpt/iter_0000004")
    assert torch.equal(torch.rand(3), expected)  # the host generator is restored
    assert tracker_set == [saved_on_cpu["rng_tracker_states"]]
    assert len(cuda_set) == 1 and cuda_set[0].view(torch.int64).tolist() == _philox(5)
    assert reports == ["model-parallel random streams start from the saved seeds: "
                       "ckpt/iter_0000004 was saved on cpu, whose streams a GPU cannot continue"]
    # the same save resumed on a CPU: its CPU streams, no CUDA call, nothing to report
    monkeypatch.setenv("MEGATRON_JREG_DEVICE", "cpu")
    rng_state.set_rng_state(saved_on_cpu, pytest.fail)
    assert tracker_set[-1] is saved_on_cpu[rng_state.CPU_STREAMS_KEY] and len(cuda_set) == 1
    # a CPU save of an earlier version (CPU streams under Megatron-LM's name, an empty CUDA
    # entry) resumed on a GPU: nothing in it a GPU can set
    monkeypatch.delenv("MEGATRON_JREG_DEVICE")
    earlier = {k: v for k, v in saved_on_cpu.items() if k != rng_state.CPU_STREAMS_KEY}
    earlier.update(cuda_rng_state=torch.empty(0, dtype=torch.uint8),
                   rng_tracker_states=saved_on_cpu[rng_state.CPU_STREAMS_KEY])
    rng_state.set_rng_state(earlier, reports.append, "ckpt/iter_0000004")
    assert len(tracker_set) == 2 and len(cuda_set) == 1
    assert reports[-1] == ("model-parallel random streams not restored: ckpt/iter_0000004 was "
                           "saved on cpu, this run is on cuda (its generators differ); they "
                           "start from --seed")
    # an earlier version's file of a GPU run (its own key names, no device), resumed on a CPU
    monkeypatch.setenv("MEGATRON_JREG_DEVICE", "cpu")
    old = {"python": saved_on_cpu["random_rng_state"], "numpy": saved_on_cpu["np_rng_state"],
           "torch": saved_on_cpu["torch_rng_state"], "tracker": saved_on_cpu["rng_tracker_states"],
           "cuda": torch.zeros(16, dtype=torch.uint8)}
    rng_state.set_rng_state(old, reports.append)
    assert len(tracker_set) == 2 and "saved on cuda, this run is on cpu" in reports[-1]
    assert torch.equal(torch.rand(3), expected)


def test_saved_device_of_megatron_lm_states(monkeypatch):
    """Megatron-LM records no device: its tracker streams tell it (a CUDA generator's Philox
    state is 16 bytes, a CPU generator's mt19937 state 5056), and a GPU run's streams are
    set on a GPU only."""
    cpu_stream = torch.get_rng_state()
    gpu_stream = torch.arange(16, dtype=torch.uint8)
    base = {"random_rng_state": None, "np_rng_state": None, "torch_rng_state": cpu_stream}
    on_gpu = dict(base, cuda_rng_state=gpu_stream,
                  rng_tracker_states={"model-parallel-rng": gpu_stream})
    on_cpu = dict(base, cuda_rng_state=torch.empty(0, dtype=torch.uint8),
                  rng_tracker_states={"model-parallel-rng": cpu_stream})
    assert rng_state.saved_device(on_gpu) == "cuda"
    assert rng_state.saved_device(on_cpu) == "cpu"
    assert rng_state.saved_device(dict(base, cuda_rng_state=gpu_stream)) == "cuda"
    assert rng_state.saved_device(dict(on_cpu, jreg_device="cuda")) == "cuda"  # recorded wins


def test_memory_gib_gpu_arm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    assert memory_gib(torch.device("cuda", 0)) == 3.0
    import psutil

    rss = psutil.Process().memory_info().rss / 2**30
    assert abs(memory_gib(torch.device("cpu")) - rss) < 0.5  # the CPU arm: resident memory


def test_memory_capacity_gpu_arm(fake_gpu, monkeypatch):
    """The out-of-memory line's capacity on a GPU: the current device's total memory."""
    asked = []

    class Props:
        total_memory = 80 * 2**30

    def properties(index):
        asked.append(index)
        return Props()
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    torch.cuda.set_device(1)
    assert device.memory_capacity() == 80 * 2**30 and asked == [1]
    monkeypatch.setenv("MEGATRON_JREG_DEVICE", "cpu")  # the CPU arm: the host's, or ulimit -v
    import psutil
    assert 0 < device.memory_capacity() <= psutil.virtual_memory().total


def test_kernel_dispatch_gpu_arm(monkeypatch):
    """The trainer's start-up line for a run on a GPU: the CUDA kernel where it was built,
    else the reference and why the install built none (the reason compiled into _C)."""
    from megatron_jreg import _C

    if torch.version.cuda is None:  # this install: a CPU torch left CUDA out, and _C says why
        assert _C.CUDA_SKIPPED == 2
        assert displacement.kernel_build() == ("the extension was built for CPU only (torch was a "
                                               "CPU build at install)")
    monkeypatch.setattr(displacement, "_CUDA_BUILT", True)
    assert displacement.fused_available("cuda")
    assert displacement.describe_impl("auto", "cuda") == ("fused",
                                                          "the CUDA kernel, --jreg-impl auto")
    monkeypatch.setattr(displacement, "_CUDA_BUILT", False)
    assert not displacement.fused_available("cuda")
    monkeypatch.setattr(_C, "CUDA_SKIPPED", 3)
    impl, why = displacement.describe_impl("auto", "cuda")
    assert impl == "torch"
    assert why.startswith("the PyTorch reference: no fused kernel for cuda: "
                          "the extension was built "
                          "for CPU only (nvcc was missing at install); reinstall")
    # the CPU arm
    assert displacement.describe_impl("auto", "cpu") == ("fused",
                                                         "the C++/OpenMP kernel, --jreg-impl auto")
    assert displacement.describe_impl("torch", "cuda")[0] == "torch"
    monkeypatch.setattr(displacement, "_C", None)  # an extension that failed to import
    assert displacement.describe_impl("auto", "cpu")[1].startswith(
        "the PyTorch reference: no fused kernel for cpu: the extension megatron_jreg._C failed to "
        "import")


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


def test_device_map_with_a_gpu_device_is_refused(fake_gpu):
    from megatron_jreg.hf_models import check_device_map

    with pytest.raises(InputError, match="--device cuda:1 and --device-map auto: the device map "
                                         "places the layers"):
        check_device_map("auto", "cuda:1")
    check_device_map("auto", "cpu")  # the CPU arm: accelerate places the layers
    check_device_map(None, "cuda")  # no device map: --device alone decides


def test_downstream_device_map_inputs_follow_the_device_mapping(fake_gpu, monkeypatch):
    """eval_downstream --device-map: lm-eval's inputs start on the GPU on a GPU machine,
    on the CPU where the run is pinned there."""
    import sys
    import types

    from megatron_jreg.downstream import harness

    seen = []
    fake = types.ModuleType("lm_eval")
    fake.simple_evaluate = lambda **kw: seen.append(kw["device"]) or {"results": {}}
    monkeypatch.setitem(sys.modules, "lm_eval", fake)
    for pinned, want in ((None, "cuda"), ("cpu", "cpu")):
        if pinned:
            monkeypatch.setenv("MEGATRON_JREG_DEVICE", pinned)
        harness.evaluate_hf("dir", [], None, dtype="float32", device="cpu", batch_size="1",
                            limit=None, num_fewshot=0, device_map="auto")
        assert seen[-1] == want
