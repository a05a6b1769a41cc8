"""JregTrainerMixin in transformers.Trainer: one step equals the same step taken by hand
with the LM loss plus the penalty of the definitions (tests/hf_training/test_hf_penalty.py's
reference), and the logs carry the JREG values."""

import copy

import pytest
import torch
import transformers
from test_hf_penalty import batch, model_of, reference_penalty

from megatron_jreg.hf_training import JregTrainerMixin


class JregTrainer(JregTrainerMixin, transformers.Trainer):
    pass


class Samples(torch.utils.data.Dataset):
    def __init__(self, ids, mask):
        labels = ids.masked_fill(mask == 0, -100)
        self.rows = [{"input_ids": i, "attention_mask": m, "labels": l}
                     for i, m, l in zip(ids, mask, labels)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_trainer_step_is_the_lm_loss_plus_the_penalty(arch, tmp_path):
    model, norm = model_of(arch)
    by_hand = copy.deepcopy(model).train()
    ids, mask = batch()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        optim="sgd",  # Adam's first step is lr * sign(g): noise on a zero gradient decides it
        report_to=[], save_strategy="no", use_cpu=True, seed=0)
    trainer = JregTrainer(model=model.train(), args=args, train_dataset=Samples(ids, mask),
                          jreg_lambda=0.5, jreg_alpha=1.0, jreg_impl="torch")
    trainer.train()
    log = [row for row in trainer.state.log_history if "loss" in row][0]
    assert {"lm_loss", "jreg_penalty", "zeta_L", "zeta_L-1", "zeta_L-2",
            "jreg/psi/layer_01", "jreg/psi/layer_03"} <= set(log)

    # the same step by hand: SGD on CE + the reference penalty
    labels = ids.masked_fill(mask == 0, -100)
    without = copy.deepcopy(by_hand)
    opt = torch.optim.SGD(by_hand.parameters(), lr=1.0)
    lm = by_hand(input_ids=ids, attention_mask=mask, labels=labels).loss
    # the Trainer may divide the summed CE by its own label count (num_items_in_batch, the
    # labels before the shift: 15 here, where the model's mean divides by 13): its LM loss
    # is the model's mean times 13/15 or 1, whatever it chose; the penalty is ours
    ratio = log["lm_loss"] / float(lm.detach())
    assert ratio == pytest.approx(1.0, rel=1e-5) or ratio == pytest.approx(13 / 15, rel=1e-5)
    penalty, _ = reference_penalty(by_hand, norm, ids, mask, 0.5, 1.0)
    (lm * (1.0 if ratio > 0.95 else 13 / 15) + penalty.float()).backward()
    opt.step()
    assert log["jreg_penalty"] == pytest.approx(float(penalty), rel=1e-4)
    assert log["loss"] == pytest.approx(log["lm_loss"] + log["jreg_penalty"], abs=1e-4)
    for (name, got), want in zip(trainer.model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # and the penalty's share of the step is visible at that tolerance: a step on the LM
    # loss alone lands elsewhere
    plain = torch.optim.SGD(without.parameters(), lr=1.0)
    (without(input_ids=ids, attention_mask=mask, labels=labels).loss
     * (1.0 if ratio > 0.95 else 13 / 15)).backward()
    plain.step()
    apart = max(float((a - b).abs().max()) for a, b in zip(trainer.model.parameters(),
                                                             without.parameters()))
    assert apart > 1e-4, apart
