"""Device parametrisation for the op tests: CPU always, CUDA behind the ``gpu`` mark."""

import pytest
import torch

from megatron_jreg.ops import fused_available


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not fused_available("cuda"):
        return "megatron_jreg._C was built without CUDA"
    return None


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason())),
        ],
    ),
]
