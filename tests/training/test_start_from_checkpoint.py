"""A run that starts from a checkpoint. It makes no layout-invariant draw (a CPU draw of every
full tensor, 20-30 s at 3B, which the load overwrites); a resume still continues exactly
(tests/training/test_reliability.py::test_resume_is_bit_exact). After a load of the weights
only, the optimizer's fp32 main parameters are the loaded weights: they were copied from the
model when the optimizer was built, before the load, and a bf16 fine-tuning run went back
to its initial weights at the first step (loss 3.16, then 5.94 at a learning rate of 1e-9)."""

import pytest
import torch
from set_up_trainer import set_up
from trainer_runs import base_args, train

from megatron_jreg.training import trainer as trainer_module


@pytest.fixture(scope="module")
def bf16_checkpoint(demo_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("bf16") / "ckpt"
    train(base_args(demo_data, bf16=True, exit_interval=2, save=save))  # the 6-step schedule
    return save


@pytest.mark.parametrize("start,draws", [
    ("fresh", 1), ("resume", 0), ("pretrained", 0), ("finetune", 0)])
def test_the_initial_draw_is_made_only_without_a_checkpoint(start, draws, bf16_checkpoint,
                                                            demo_data, monkeypatch):
    made = []
    real = trainer_module.layout_invariant_init
    monkeypatch.setattr(trainer_module, "layout_invariant_init",
                        lambda *args: made.append(args) or real(*args))
    flags = {"fresh": {}, "resume": {"load": bf16_checkpoint},
             "pretrained": {"pretrained_checkpoint": bf16_checkpoint, "finetune": True},
             "finetune": {"load": bf16_checkpoint, "finetune": True}}[start]
    with set_up(base_args(demo_data, bf16=True, **flags)) as built:
        assert ("loaded checkpoint" in built.log or "fine-tuning from" in built.log) == bool(flags)
    assert len(made) == draws


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_weights_only_load_trains_from_the_loaded_weights(distributed_optimizer,
                                                            bf16_checkpoint, demo_data):
    """A step at a learning rate of 1e-12 leaves every bf16 weight as loaded: the step starts
    from main parameters equal to them."""
    argv = base_args(demo_data, bf16=True, pretrained_checkpoint=bf16_checkpoint, finetune=True,
                     lr=1e-12, use_distributed_optimizer=distributed_optimizer or None)
    with set_up(argv) as built:
        trainer = built.trainer
        loaded = [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()]
        assert not trainer.train_step()["skipped"]
        after = [p.detach() for chunk in trainer.model for p in chunk.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(loaded, after))
