"""PsiAccumulator, the one accumulator of Psi_l: the TP ranks' shares add up to one rank's sums.

Each simulated TP rank adds what ``owns_tokens`` gives it, in the layout ``local_token_mask``
slices; adding the ranks' accumulators (what ``reduce`` does over the TP group) must give
the sums and counts of one rank holding every token. The tracker's and eval_jump's
accumulators are this class.
"""

import pytest
import torch

from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.config.model import JregConfig
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.ops.psi_accumulator import PsiAccumulator, local_token_mask, owns_tokens


def _states(seed: int, s: int = 8, b: int = 3, h: int = 5):
    gen = torch.Generator().manual_seed(seed)
    h_prev = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    h_next = h_prev + 0.3 * torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, s, generator=gen) > 0.3  # [b, s]
    return h_prev, h_next, mask


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_shares_add_up_to_one_rank(sequence_parallel):
    tp = 2
    one = PsiAccumulator(2, impl="torch")
    ranks = [PsiAccumulator(2, impl="torch") for _ in range(tp)]
    for layer, seed in ((1, 0), (2, 1), (1, 2), (2, 3)):
        h_prev, h_next, mask = _states(seed)
        one.add(layer, h_prev, h_next, mask.t())
        for rank, acc in enumerate(ranks):
            if not owns_tokens(sequence_parallel, rank):
                continue  # the same tokens as TP rank 0
            local = local_token_mask(mask, sequence_parallel, rank, tp)
            chunk = slice(None) if not sequence_parallel else slice(rank * 4, (rank + 1) * 4)
            acc.add(layer, h_prev[chunk], h_next[chunk], local)
    total = PsiAccumulator(2)
    for acc in ranks:
        total.merge(acc)
    assert total.counts == one.counts
    assert total.psi_sums == pytest.approx(one.psi_sums, rel=1e-12)


def test_local_token_mask_slices_the_sequence():
    mask = torch.arange(12).reshape(2, 6) % 5 != 0  # [b, s]
    assert torch.equal(local_token_mask(mask, False, 1, 2), mask.t())
    assert torch.equal(local_token_mask(mask, True, 1, 2), mask.t()[3:])
    assert owns_tokens(True, 1) and owns_tokens(False, 0) and not owns_tokens(False, 1)


def test_reduce_without_groups_is_a_copy_and_means_divide():
    acc = PsiAccumulator(3, dtype=torch.float32)
    acc.add_sums(1, torch.tensor(0.5), 1.0)
    acc.add_sums(1, torch.tensor(0.25), 1.0)
    acc.add_sums(3, torch.tensor(0.125), 1.0)
    total = acc.reduce([])
    acc.reset()
    assert total.counts == [2, 0, 1] and acc.counts == [0, 0, 0]
    assert total.means().tolist() == [0.375, 0.0, 0.125]  # a layer counted nowhere gives 0


def test_tracker_and_eval_share_the_accumulator():
    tracker = JregTracker(JregConfig(lam=0.0), 2)
    assert isinstance(tracker._psi, PsiAccumulator)
    assert issubclass(JumpAccumulator, PsiAccumulator)
    h_prev, h_next, _ = _states(5)
    for layer in (1, 2):
        tracker.observe(layer, h_prev.float(), h_next.float())
    acc = JumpAccumulator(2)
    for layer in (1, 2):
        acc.add(layer, h_prev.float(), h_next.float())
    assert tracker.reduce()["psi"] == pytest.approx(acc.displacement(), rel=1e-6)
