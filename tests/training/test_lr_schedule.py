"""The trainer's LR schedules, step by step, against their closed forms."""

import math
from types import SimpleNamespace

import pytest

from megatron_jreg.config.run import OptimConfig, TrainingConfig
from megatron_jreg.training.optimizer import build_scheduler

ITERS, G = 100, 8


def lrs(**optim):
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_scheduler(optimizer, OptimConfig(**optim),
                                TrainingConfig(train_iters=ITERS, global_batch_size=G,
                                               micro_batch_size=G))
    out = [optimizer.param_groups[0]["lr"]]  # before the first step
    for _ in range(ITERS):
        scheduler.step(increment=G)
        out.append(optimizer.param_groups[0]["lr"])
    return out  # out[k] = lr after k steps


def test_cosine_with_warmup():
    got = lrs(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_style="cosine")
    assert got[5] == pytest.approx(1e-3 * 5 / 10)
    assert got[10] == pytest.approx(1e-3)
    k = 55  # halfway through the decay
    ratio = (k - 10) / (ITERS - 10)
    assert got[k] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * ratio)))
    assert got[ITERS] == pytest.approx(1e-4)


def test_linear_and_constant():
    got = lrs(lr=1e-3, min_lr=0.0, lr_decay_style="linear")
    assert got[50] == pytest.approx(5e-4)
    assert lrs(lr=2e-4, lr_decay_style="constant") == pytest.approx([2e-4] * (ITERS + 1))


def test_wsd_holds_then_decays():
    got = lrs(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_style="WSD", lr_wsd_decay_iters=20,
              lr_wsd_decay_style="linear")
    assert got[10] == got[50] == got[80] == pytest.approx(1e-3)  # stable phase
    assert got[90] == pytest.approx(1e-4 + (1e-3 - 1e-4) * 0.5)  # halfway through the final decay
    assert got[ITERS] == pytest.approx(1e-4)
