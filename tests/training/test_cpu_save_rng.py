"""A CPU run's checkpoint resumes exactly on the CPU with dropout (its own CPU streams), and
holds under Megatron-LM's names the CUDA form of its seeds: what a GPU run, ours or
Megatron-LM's (which sets them without a check unless --no-load-rng), sets. The GPU resume
itself is bench/gpu_checks.py's "resume of a CPU save"."""

import io
import os
import pickle
import subprocess
import sys

import torch
from trainer_runs import REPO, run_env


def _rng_entries(iteration_dir):
    """The ``rng_state`` sharded objects of an iteration directory, read from its shards
    (our own save: trusted here), keyed by their dist-checkpointing key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(os.path.join(iteration_dir, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    out = {}
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) and key.startswith("rng_state"):
            info = metadata.storage_data[MetadataIndex(key)]
            with open(os.path.join(iteration_dir, info.relative_path), "rb") as f:
                f.seek(info.offset)
                out[key] = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    return out


def test_cpu_resume_with_dropout_is_exact_and_the_save_carries_the_cuda_form(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, "bench/trainer_resume_check.py", "--device", "cpu",
                           "--dropout", "0.1", "--train-iters", "4", "--keep", str(work)],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(bit-exact): ok" in proc.stdout
    assert "model-parallel random streams" not in proc.stdout  # same device: nothing to say

    entries = _rng_entries(work / "ckpt_full" / "iter_0000002")
    assert len(entries) == 1  # one pipeline x tensor rank
    (state,) = entries.values()
    while isinstance(state, list):  # megatron-core's object list ([entry] per data-parallel rank)
        assert len(state) == 1
        state = state[0]
    seed = 1234  # the check's --seed; megatron-core's rule for the generator and streams
    expected = {"data-parallel-rng": seed, "model-parallel-rng": seed + 2718,
                "expert-parallel-rng": seed + 1024}

    def philox(tensor):
        return tensor.dtype, tensor.shape, tensor.view(torch.int64).tolist()

    assert philox(state["cuda_rng_state"]) == (torch.uint8, (16,), [seed, 0])
    assert {name: philox(s) for name, s in state["rng_tracker_states"].items()} == {
        name: (torch.uint8, (16,), [value, 0]) for name, value in expected.items()}
    # the CPU streams the resume continued, moved on by the dropout of steps 1-2
    cpu_streams = state["jreg_cpu_rng_tracker_states"]
    assert set(cpu_streams) == set(expected)
    fresh = torch.Generator()
    fresh.manual_seed(seed + 2718)
    assert cpu_streams["model-parallel-rng"].numel() == fresh.get_state().numel()
    assert not torch.equal(cpu_streams["model-parallel-rng"], fresh.get_state())
    assert state["jreg_device"] == "cpu"
