"""The CUDA generator state a CPU save carries (platform.device.seeded_cuda_generator_state):
on a GPU it equals the state torch.cuda.manual_seed leaves, torch.cuda.set_rng_state takes
it, and the draws after it are the seeded generator's. The layout test runs everywhere."""

import pytest
import torch

from megatron_jreg.platform.device import seeded_cuda_generator_state


def test_layout_is_seed_then_offset():
    for seed in (0, 1234, 2**32 - 1 + 2718 + 7, 2**64 - 1):
        state = seeded_cuda_generator_state(seed)
        assert state.dtype == torch.uint8 and state.shape == (16,)
        assert int.from_bytes(bytes(state[:8].tolist()), "little") == seed
        assert bytes(state[8:].tolist()) == bytes(8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", [1234, 1234 + 2718 + 1, 2**40 + 3])
def test_equals_the_seeded_cuda_generator(seed):
    torch.cuda.manual_seed(seed)
    assert torch.equal(torch.cuda.get_rng_state(), seeded_cuda_generator_state(seed))
    expected = torch.rand(64, device="cuda")
    torch.cuda.manual_seed(seed + 1)
    torch.cuda.set_rng_state(seeded_cuda_generator_state(seed))
    assert torch.equal(torch.rand(64, device="cuda"), expected)
