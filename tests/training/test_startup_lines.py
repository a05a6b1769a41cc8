"""The trainer's first lines say what was resolved: the JREG implementation and why, the
transformer implementation, the core attention, the fusions (the GPU arm of the JREG line, a
kernel built without CUDA, is tests/platform/test_device_arms.py::test_kernel_dispatch_gpu_arm;
the fusions' arms with Transformer Engine or apex are tests/model/test_fusions.py)."""

import pytest
from trainer_runs import base_args, train


@pytest.mark.parametrize("impl,line", [
    ("auto", "JREG implementation: fused (the C++/OpenMP kernel, --jreg-impl auto)"),
    ("fused", "JREG implementation: fused (the C++/OpenMP kernel, --jreg-impl fused)"),
    ("torch",
     "JREG implementation: torch (the PyTorch reference, requested with --jreg-impl torch)"),
])
def test_start_up_names_the_jreg_implementation(demo_data, impl, line):
    proc = train(base_args(demo_data, train_iters=1, jreg_impl=impl))
    lines = proc.stdout.splitlines()
    assert lines[0] == line, proc.stdout[:2000]
    assert lines[1].startswith("transformer implementation: local (")
    assert lines[2] == ("core attention: sdpa (no Transformer Engine: PyTorch's SDPA "
                        "(FlashAttention on GPUs))")
    assert lines[3] == ("rope fusion: off (the fused RoPE kernel is Transformer Engine's; "
                        "the local implementation applies RoPE in PyTorch)")
    assert lines[4] == ("gradient-accumulation fusion: off (megatron-core's linears need apex's "
                        "fused_weight_gradient_mlp_cuda, not installed)")
