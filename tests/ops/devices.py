"""Device parametrisation for the op tests: CPU always, CUDA behind the ``gpu`` mark.

The CUDA cases skip only where there is no CUDA device. On a machine with one, a kernel
built without CUDA fails them (and test_cuda_kernel_is_built_where_a_gpu_is says why):
``pytest -m gpu`` never passes having run nothing."""

import pytest
import torch


def _cuda_skip_reason():
    return None if torch.cuda.is_available() else "no CUDA device"


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
