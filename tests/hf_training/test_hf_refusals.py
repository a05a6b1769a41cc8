"""What HFJreg and JregTrainerMixin refuse, and when: a lambda that is not a finite number
>= 0, an alpha that is not finite, an unknown impl or weighting are InputErrors naming the
argument and the rule at construction (before any forward, before the Trainer trains); a
layer list holding one module in two slots and an encoder-decoder model are refused
naming the slots / the class. With ``Trainer(model_init=...)`` the hooks sit on the model
that trains, and ``penalty`` with nothing recorded says the hooks may be on another model."""

import math

import pytest
import torch
import transformers
from test_hf_penalty import batch, model_of
from test_hf_trainer import Samples

from megatron_jreg.errors import InputError
from megatron_jreg.hf_training import HFJreg, JregTrainerMixin


class JregTrainer(JregTrainerMixin, transformers.Trainer):
    pass


@pytest.mark.parametrize("lam", [float("nan"), float("inf"), -1.0, "abc", None, "1.0"])
def test_a_lambda_that_is_not_a_finite_number_at_least_zero_is_refused(lam):
    model, _ = model_of("llama")
    with pytest.raises(InputError, match=r"^HFJreg: lam must be a finite number >= 0, got "):
        HFJreg(model, lam=lam)
    assert not any(layer._forward_hooks for layer in model.model.layers)


@pytest.mark.parametrize("alpha", [float("nan"), float("-inf"), "abc", None])
def test_an_alpha_that_is_not_finite_is_refused(alpha):
    model, _ = model_of("llama")
    with pytest.raises(InputError, match=r"^HFJreg: alpha must be a finite number, got "):
        HFJreg(model, alpha=alpha)


def test_an_impl_typo_is_refused_at_construction():
    model, _ = model_of("llama")
    with pytest.raises(InputError, match=r"HFJreg: impl must be one of \['auto', 'fused', "
                                         r"'torch'\], got 'fsued'"):
        HFJreg(model, impl="fsued")
    with pytest.raises(InputError, match=r"HFJreg: weighting must be one of .*'sofmax'"):
        HFJreg(model, weighting="sofmax")


def test_valid_settings_still_give_a_finite_penalty():
    model, _ = model_of("llama")
    jreg = HFJreg(model, lam=0, alpha=-2, weighting="softmax", impl="torch")
    ids, mask = batch()
    model(input_ids=ids, attention_mask=mask)
    value = jreg.penalty(mask)
    assert float(value["penalty"].detach()) == 0.0 and math.isfinite(float(value["R"]))


def test_one_module_in_two_layer_slots_is_refused():
    model, _ = model_of("llama")
    model.model.layers[2] = model.model.layers[1]
    with pytest.raises(InputError, match=r"model\.layers\[1\] and model\.layers\[2\] are the "
                                         r"same module; JREG needs one module per layer"):
        HFJreg(model)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoder_model_is_refused_naming_its_class(name):
    torch.manual_seed(0)
    if name == "t5":  # 2 encoder blocks, 3 decoder blocks: only the encoder's list matches
        config = transformers.T5Config(vocab_size=97, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                       num_decoder_layers=3, num_heads=4)
        model = transformers.T5ForConditionalGeneration(config)
    else:  # 3 encoder layers, 2 decoder layers
        config = transformers.BartConfig(vocab_size=97, d_model=16, encoder_layers=3,
                                         decoder_layers=2, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=32,
                                         decoder_ffn_dim=32)
        model = transformers.BartForConditionalGeneration(config)
    with pytest.raises(InputError, match=rf"^{type(model).__name__} is an encoder-decoder model; "
                                         "JREG's displacement is defined for a decoder-only stack"):
        HFJreg(model)


def _args(tmp_path, steps=1):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"jreg_lambda": float("nan")}, r"jreg_lambda must be a finite number >= 0, got nan"),
    ({"jreg_lambda": "abc"}, r"jreg_lambda must be a finite number >= 0, got 'abc'"),
    ({"jreg_alpha": None}, r"jreg_alpha must be a finite number, got None"),
    ({"jreg_impl": "fsued"}, r"jreg_impl must be one of"),
])
def test_the_trainer_refuses_bad_jreg_settings_when_built(kwargs, message, tmp_path):
    model, _ = model_of("llama")
    ids, mask = batch()
    with pytest.raises(InputError, match=rf"^JregTrainer: {message}"):
        JregTrainer(model=model.train(), args=_args(tmp_path), train_dataset=Samples(ids, mask),
                    **kwargs)


def test_with_model_init_the_hooks_sit_on_the_model_that_trains(tmp_path):
    made = []

    def model_init():
        made.append(model_of("llama")[0].train())
        return made[-1]

    ids, mask = batch()
    trainer = JregTrainer(model_init=model_init, args=_args(tmp_path),
                          train_dataset=Samples(ids, mask), jreg_lambda=0.5, jreg_impl="torch")
    trainer.train()
    assert len(made) == 2  # one in __init__, a fresh one at train()
    assert trainer.model is made[1] and trainer.jreg.layers is made[1].model.layers
    assert not any(layer._forward_hooks for layer in made[0].model.layers)  # removed
    log = [row for row in trainer.state.log_history if "loss" in row][0]
    assert math.isfinite(log["jreg_penalty"]) and log["jreg_penalty"] > 0


def test_penalty_with_nothing_recorded_says_the_hooks_may_be_on_another_model():
    hooked, _ = model_of("llama")
    other, _ = model_of("llama")
    jreg = HFJreg(hooked)
    ids, mask = batch()
    other(input_ids=ids, attention_mask=mask)
    with pytest.raises(RuntimeError, match=r"0 of 3 layers were recorded; .*model\.layers carries "
                                           r"the hooks \(if another model ran"):
        jreg.penalty(mask)
