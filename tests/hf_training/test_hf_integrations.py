"""JREG (megatron_jreg.hf_training) inside the training stacks people use with Hugging Face
models, each checked against the definitions' reference (test_hf_penalty.py's
``reference_penalty``: ``output_hidden_states`` with the final norm taken out):

* TRL's ``SFTTrainer`` (``JregSFTTrainer(JregTrainerMixin, trl.SFTTrainer)``), on a tiny
  Llama with chat data (padded batches) and on GPT-NeoX with text data in padding-free
  mode (packed rows, ``position_ids`` and no ``attention_mask``) over 2 gradient-accumulation
  micro-batches: the logs carry the JREG values, the logged penalty is the reference's on
  the batches the trainer fed (recorded from its collator) with the weights before the step,
  the logged loss is ``lm_loss + jreg_penalty``, and the SGD update is
  ``-lr * (grad LM + grad penalty)`` with the penalty averaged over the micro-batches, the
  penalty's share of it far above the tolerance (so a penalty that never reached the
  gradient, or one summed over micro-batches, fails).
* PEFT/LoRA: HFJreg finds the decoder layers through a ``PeftModel``; its penalty equals the
  reference on the merged model, its gradient reaches the LoRA parameters only and equals
  the reference's through the same PeftModel; a Trainer step on a PeftModel is the step by
  hand and moves the LoRA parameters only.
* Mixed precision: under CPU bf16 autocast and with bf16 weights the penalty is fp32,
  finite, the fp32 reference's within bf16's precision and not bitwise the fp32 value (the
  half-precision path ran), its gradient finite; a Trainer run with bf16=True logs the same;
  CPU fp16 autocast likewise within fp16's precision, and a Trainer run with fp16=True
  (accepted on CPU, where accelerate then runs fp32) logs the reference's penalty.
* The plain loop: ``HFJreg.add_penalty`` returns the loss plus the reference penalty (with
  the reference's gradient), and SGD with a large lambda lowers the last layer's Psi well
  below a lambda=0 run from the same initialisation.
"""

import copy
import math

import datasets
import peft
import pytest
import tokenizers
import torch
import transformers
import trl
from test_hf_penalty import batch, model_of, reference_penalty
from test_hf_trainer import JregTrainer, Samples

from megatron_jreg.hf_training import HFJreg, JregTrainerMixin

LAM, ALPHA = 0.5, 1.0


class JregSFTTrainer(JregTrainerMixin, trl.SFTTrainer):
    pass


# --- a tokenizer and data made here (no hub) -------------------------------------------

WORDS = ("user assistant the a cat dog sat on mat ran fast slow big small red blue sky sea "
         "is was and or where what sun hot cold").split()


def word_tokenizer():
    """A word-level tokenizer of 30 ids (within the tiny models' 97), with pad, eos and a
    chat template."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> "
                               "{% endfor %}")
    return tokenizer


CHATS = [[{"role": "user", "content": "where is the cat"},
          {"role": "assistant", "content": "the cat sat on the mat"}],
         [{"role": "user", "content": "what is blue"},
          {"role": "assistant", "content": "the sky and the sea"}]]
TEXTS = ["the cat sat on the mat", "a dog ran fast", "the sun is hot and big",
         "the sea was cold"]


class Recorder:
    """A data collator that keeps a copy of every batch it makes (what the trainer feeds)."""

    def __init__(self, collator):
        self.collator, self.batches = collator, []

    def __call__(self, rows):
        out = self.collator(rows)
        self.batches.append({k: v.clone() for k, v in out.items() if torch.is_tensor(v)})
        return out


def sgd_args(cls, tmp_path, **extra):
    # SGD, constant lr 1, no clipping or decay: the update is -grad, checkable by hand.
    # SFTConfig's own defaults are bf16=True (CPU autocast: the SFT tests turn it off to
    # compare at fp32 precision) and gradient_checkpointing=True (left on: the penalty's
    # gradient then runs through the checkpointed layers)
    return cls(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
               learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0,
               max_grad_norm=0.0, logging_steps=1, optim="sgd", report_to=[],
               save_strategy="no", use_cpu=True, seed=0, **extra)


def train_log(trainer):
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 1, trainer.state.log_history
    log = logs[0]
    layers = trainer.jreg.num_layers
    assert {"lm_loss", "jreg_penalty", "zeta_L", "zeta_L-1", "zeta_L-2"} <= set(log)
    assert {f"jreg/psi/layer_{l:02d}" for l in range(1, layers + 1)} <= set(log)
    assert all(math.isfinite(v) for k, v in log.items() if isinstance(v, float)), log
    return log


def grads_of(loss, model):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_logged_step(log, before, after, lm, penalty):
    """The log holds ``lm`` and ``penalty`` (references on ``before``) and their sum, and
    ``after`` is one SGD step (lr 1) on that sum from ``before``."""
    assert log["jreg_penalty"] == pytest.approx(penalty.item(), rel=1e-5)
    assert log["lm_loss"] == pytest.approx(lm.item(), rel=1e-5)
    assert log["loss"] == pytest.approx(log["lm_loss"] + log["jreg_penalty"], rel=1e-5)
    assert_sgd_update(before, after, grads_of(lm, before), grads_of(penalty, before))


def assert_sgd_update(before, after, lm_grads, penalty_grads, tol=2e-6):
    """``after`` = ``before`` - (lm + penalty gradients), and the penalty's share is far
    (>= 50x) above the tolerance, so a step without it (or with it doubled) fails."""
    share = 0.0
    for (name, b), a in zip(before.named_parameters(), after.parameters()):
        want = b.detach() - lm_grads.get(name, 0) - penalty_grads.get(name, 0)
        torch.testing.assert_close(a.detach(), want, rtol=1e-5, atol=tol, msg=name)
        if name in penalty_grads:
            share = max(share, float(penalty_grads[name].abs().max()))
    assert share > 50 * tol, share


def packed_reference(model, norm_path, fed, lam, alpha):
    """(the penalty, the CE summed over the labels, their count) of a padding-free batch
    (one row of sequences packed one after another, ``position_ids`` restarting at 0 for
    each, every token real), from each sequence run on its own: Psi_l is the mean over all
    tokens, so each sequence's reference Psi_l counts by its length."""
    ids, pos, labels = fed["input_ids"][0], fed["position_ids"][0], fed["labels"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    psis, lengths, ce_sum, count = [], [], 0.0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        seq, lab = ids[None, a:b], labels[None, a:b]
        _, psi = reference_penalty(model, norm_path, seq, torch.ones_like(seq), 1.0, alpha)
        psis.append(psi * (b - a))
        lengths.append(b - a)
        n = int((lab[:, 1:] != -100).sum())  # the Trainer's count: the shifted labels
        ce_sum = ce_sum + model(input_ids=seq, labels=lab).loss * n
        count += n
    psi = torch.stack(psis).sum(0) / sum(lengths)
    weights = torch.softmax(alpha * torch.arange(1, len(psi) + 1, dtype=psi.dtype), 0)
    return lam * (weights * psi).sum(), ce_sum, count


# --- 1. TRL's SFTTrainer -----------------------------------------------------------------

def test_sft_trainer_chat_data_on_llama(tmp_path):
    """Padded chat batches (attention_mask): logged penalty = reference on the fed batch
    before the step, loss = lm_loss + penalty, update = -(grad CE + grad penalty)."""
    model, norm = model_of("llama")
    before = copy.deepcopy(model).train()
    trainer = JregSFTTrainer(
        model=model.train(), args=sgd_args(trl.SFTConfig, tmp_path, bf16=False),
        train_dataset=datasets.Dataset.from_list([{"messages": m} for m in CHATS]),
        processing_class=word_tokenizer(), jreg_lambda=LAM, jreg_alpha=ALPHA, jreg_impl="torch")
    assert not trainer.padding_free
    trainer.data_collator = recorder = Recorder(trainer.data_collator)
    trainer.train()
    log = train_log(trainer)

    (fed,) = recorder.batches
    ids, mask, labels = fed["input_ids"], fed["attention_mask"], fed["labels"]
    assert ids.shape[0] == 2 and not bool(mask.all()), "expected one padded row"
    assert int(ids.max()) < len(WORDS) + 3 and bool((labels[mask == 0] == -100).all())
    penalty, _ = reference_penalty(before, norm, ids, mask, LAM, ALPHA)
    # SFTTrainer's NLL: summed over the shifted labels / their count = the model's mean CE
    lm = before(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert_logged_step(log, before, trainer.model, lm, penalty)


def test_sft_trainer_padding_free_with_accumulation_on_gpt_neox(tmp_path):
    """Padding-free text batches (packed rows, position_ids, no attention_mask: every
    token real) over 2 accumulation micro-batches: the penalty's share of the step is the
    mean of the micro-batches' penalties; the logged lm_loss is the step's CE."""
    model, norm = model_of("gpt_neox")
    before = copy.deepcopy(model).train()
    args = sgd_args(trl.SFTConfig, tmp_path, bf16=False, gradient_accumulation_steps=2,
                    padding_free=True, max_length=None)
    trainer = JregSFTTrainer(
        model=model.train(), args=args,
        train_dataset=datasets.Dataset.from_list([{"text": t} for t in TEXTS]),
        processing_class=word_tokenizer(), jreg_lambda=LAM, jreg_alpha=ALPHA, jreg_impl="torch")
    assert trainer.padding_free and trainer._loss_is_scaled_for_ga(1)
    trainer.data_collator = recorder = Recorder(trainer.data_collator)
    trainer.train()
    log = train_log(trainer)

    assert len(recorder.batches) == 2
    penalties, sums, counts = [], [], []
    for fed in recorder.batches:
        assert "attention_mask" not in fed and fed["input_ids"].shape[0] == 1
        assert int((fed["position_ids"] == 0).sum()) == 2  # two sequences packed in the row
        penalty, ce_sum, count = packed_reference(before, norm, fed, LAM, ALPHA)
        penalties.append(penalty)
        sums.append(ce_sum)
        counts.append(count)
    penalty = (penalties[0] + penalties[1]) / 2
    # the micro-batches' penalties differ by far more than the tolerance below: the logged
    # mean is not either one's
    assert abs((penalties[0] - penalties[1]).item()) > 20 * 1e-5 * penalty.item()
    lm = (sums[0] + sums[1]) / sum(counts)  # the Trainer's CE over the accumulated batch
    assert_logged_step(log, before, trainer.model, lm, penalty)


# --- 2. PEFT / LoRA -----------------------------------------------------------------------

def lora_model(arch="llama"):
    model, norm = model_of(arch)
    torch.manual_seed(3)
    # init_lora_weights=False: B is random too (B = 0 would make every LoRA gradient of A zero)
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj", "down_proj"], r=4,
                             lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config), "base_model.model." + norm


def test_lora_penalty_and_gradient_equal_the_reference():
    """Through a PeftModel: the layers are found, Psi and the penalty are the reference's
    (on the PeftModel and on the merged plain Llama), the gradient reaches exactly the
    trainable (LoRA) parameters and equals the reference's."""
    model, norm = lora_model()
    ids, mask = batch()
    jreg = HFJreg(model, lam=LAM, alpha=ALPHA, impl="torch")
    assert jreg.path == "base_model.model.model.layers" and jreg.num_layers == 3
    model(input_ids=ids, attention_mask=mask)
    got = jreg.penalty(mask)
    grads = grads_of(got["penalty"], model)
    jreg.remove()

    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert set(grads) == lora  # the frozen base gets no gradient
    want, psi = reference_penalty(model, norm, ids, mask, LAM, ALPHA)
    want_grads = grads_of(want, model)
    torch.testing.assert_close(got["psi"], psi.detach().float(), rtol=1e-5, atol=1e-7)
    for name in lora:
        assert float(grads[name].abs().max()) > 1e-6, name  # 10x the atol below
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-7, msg=name)

    # the adapter changes the penalty, and the merged model (plain Llama) gives the same one
    merged = copy.deepcopy(model).merge_and_unload()
    assert type(merged) is transformers.LlamaForCausalLM
    merged_penalty, _ = reference_penalty(merged, "model.norm", ids, mask, LAM, ALPHA)
    base_penalty, _ = reference_penalty(model_of("llama")[0], "model.norm", ids, mask, LAM, ALPHA)
    torch.testing.assert_close(got["penalty"].detach(), merged_penalty.detach(), rtol=1e-5,
                               atol=1e-7)
    assert abs((merged_penalty - base_penalty).item()) > 1e-3


def test_trainer_step_on_a_peft_model(tmp_path):
    """A 1-step JregTrainer run on a PeftModel logs the reference penalty and moves only
    the LoRA parameters, by -(grad CE + grad penalty)."""
    model, norm = lora_model()
    before = copy.deepcopy(model).train()
    ids, mask = batch()
    args = sgd_args(transformers.TrainingArguments, tmp_path)
    trainer = JregTrainer(model=model.train(), args=args, train_dataset=Samples(ids, mask),
                          jreg_lambda=LAM, jreg_alpha=ALPHA, jreg_impl="torch")
    trainer.train()
    log = train_log(trainer)
    penalty, _ = reference_penalty(before, norm, ids, mask, LAM, ALPHA)
    assert log["jreg_penalty"] == pytest.approx(penalty.item(), rel=1e-5)
    assert log["loss"] == pytest.approx(log["lm_loss"] + log["jreg_penalty"], rel=1e-5)
    labels = ids.masked_fill(mask == 0, -100)
    lm = before(input_ids=ids, attention_mask=mask, labels=labels).loss
    # the Trainer's CE may count the unshifted labels (see test_hf_trainer.py): 13/15 or 1
    ratio = log["lm_loss"] / lm.item()
    assert ratio == pytest.approx(1.0, rel=1e-5) or ratio == pytest.approx(13 / 15, rel=1e-5)
    lm_grads = grads_of(lm * (1.0 if ratio > 0.95 else 13 / 15), before)
    penalty_grads = grads_of(penalty, before)
    # frozen base weights stay put (no gradient), LoRA ones move by -(grad CE + grad penalty)
    assert_sgd_update(before, trainer.model, lm_grads, penalty_grads)
    moved = {n for (n, a), b in zip(trainer.model.named_parameters(), before.parameters())
             if not torch.equal(a, b)}
    assert moved and all("lora_" in n for n in moved)


# --- 3. mixed precision -------------------------------------------------------------------

# bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3). Psi_l = mean (1 - cos)/2 of
# two hidden states; every bf16 matmul (and, with bf16 weights, the bf16 residual stream)
# leaves relative errors of about u in the states, which move (1 - cos) by about u relative
# to its size here (Psi 0.01-0.5, cos far from 1); the mean over tokens averages them down.
# Measured on the 4 tiny architectures: per-layer Psi within 0.13% (autocast) and 0.42%
# (bf16 weights), the penalty within 0.08%. 1% (5 u) leaves room for other CPUs' kernels.
# fp16 (u = 2^-11) measured 0.024%: 0.2% (4 u). Each test also asserts the half-precision
# result is not the fp32 one, so the half-precision path really ran.
BF16_RTOL, FP16_RTOL = 1e-2, 2e-3


def _close_not_equal(got, want, rtol):
    assert math.isfinite(got) and got == pytest.approx(want, rel=rtol)
    assert got != pytest.approx(want, rel=1e-6), "no half-precision rounding happened"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bf16_autocast_and_bf16_weights(arch):
    """HFJreg's penalty and Psi under CPU bf16 autocast (fp32 weights), then with the
    weights themselves in bf16: fp32 values within BF16_RTOL of the fp32 reference."""
    model, norm = model_of(arch)
    ids, mask = batch()
    want, psi_want = reference_penalty(model, norm, ids, mask, LAM, ALPHA)
    want, psi_want = want.item(), psi_want.detach().float()

    jreg = HFJreg(model, lam=LAM, alpha=ALPHA, impl="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=mask)
        got = jreg.penalty(mask)
    assert got["penalty"].dtype == torch.float32 and got["psi"].dtype == torch.float32
    _close_not_equal(got["penalty"].item(), want, BF16_RTOL)
    torch.testing.assert_close(got["psi"], psi_want, rtol=BF16_RTOL, atol=0)
    got["penalty"].backward()  # the graph runs back through the bf16 ops
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)

    model.zero_grad()
    model.to(torch.bfloat16)
    model(input_ids=ids, attention_mask=mask)
    h_prev, h_last = jreg._pairs[jreg.num_layers]
    assert h_prev.dtype == h_last.dtype == torch.bfloat16  # the states really are bf16
    got = jreg.penalty(mask)
    assert got["penalty"].dtype == torch.float32 and got["psi"].dtype == torch.float32
    _close_not_equal(got["penalty"].item(), want, BF16_RTOL)
    torch.testing.assert_close(got["psi"], psi_want, rtol=BF16_RTOL, atol=0)


def _trainer_run(tmp_path, **precision):
    """(the training log, the fp32 reference penalty, the Trainer) of a 1-step run."""
    model, norm = model_of("llama")
    ids, mask = batch()
    want, _ = reference_penalty(model, norm, ids, mask, LAM, ALPHA)
    trainer = JregTrainer(model=model.train(),
                          args=sgd_args(transformers.TrainingArguments, tmp_path, **precision),
                          train_dataset=Samples(ids, mask), jreg_lambda=LAM, jreg_alpha=ALPHA,
                          jreg_impl="torch")
    trainer.train()
    return train_log(trainer), want.item(), trainer


def test_trainer_bf16_on_cpu(tmp_path):
    """TrainingArguments(bf16=True, use_cpu=True): finite logs, the penalty the fp32
    reference's within BF16_RTOL (and rounded: the autocast ran), loss = lm + penalty."""
    log, want, _ = _trainer_run(tmp_path, bf16=True)  # accelerate: CPU bf16 autocast
    _close_not_equal(log["jreg_penalty"], want, BF16_RTOL)
    assert log["loss"] == pytest.approx(log["lm_loss"] + log["jreg_penalty"], rel=1e-5)


def test_fp16_autocast_on_cpu_and_the_trainers_fp16(tmp_path):
    """torch's CPU autocast does fp16: the penalty is fp32 and the reference's within fp16's
    precision. The Trainer takes fp16=True with use_cpu=True, but accelerate does not
    autocast fp16 on CPU (native_amp False: the run is fp32); its log is still the
    reference's within that tolerance."""
    model, norm = model_of("llama")
    ids, mask = batch()
    want, _ = reference_penalty(model, norm, ids, mask, LAM, ALPHA)
    jreg = HFJreg(model, lam=LAM, alpha=ALPHA, impl="torch")
    with torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids, attention_mask=mask)
        got = jreg.penalty(mask)
    assert got["penalty"].dtype == torch.float32
    _close_not_equal(got["penalty"].item(), want.item(), FP16_RTOL)

    log, want, trainer = _trainer_run(tmp_path, fp16=True)
    assert trainer.accelerator.mixed_precision == "fp16"
    assert log["jreg_penalty"] == pytest.approx(want, rel=FP16_RTOL)
    assert log["loss"] == pytest.approx(log["lm_loss"] + log["jreg_penalty"], rel=1e-5)


# --- 4. the plain loop --------------------------------------------------------------------

def test_add_penalty_is_the_loss_plus_the_reference_penalty():
    """HFJreg.add_penalty: the total is CE + the reference penalty, Psi the reference's,
    and the total's gradient the gradient of CE + the reference penalty."""
    model, norm = model_of("llama")
    model.train()
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    jreg = HFJreg(model, lam=LAM, alpha=ALPHA, impl="torch")
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    total, values = jreg.add_penalty(out.loss, mask)
    got_grads = grads_of(total, model)
    jreg.remove()
    lm = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    penalty, psi = reference_penalty(model, norm, ids, mask, LAM, ALPHA)
    assert penalty.item() > 1e-3
    torch.testing.assert_close(total.detach(), (lm + penalty).detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(values["psi"], psi.detach().float(), rtol=1e-5, atol=1e-7)
    want_grads = grads_of(lm + penalty, model)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_sgd_with_a_large_lambda_lowers_the_last_layers_psi():
    """The same SGD steps from the same init, lambda = 20 against lambda = 0 (all else
    equal): the last layer's Psi, measured by the reference, ends several times lower."""
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    final = {}
    for lam in (0.0, 20.0):
        model, norm = model_of("llama")
        model.train()
        jreg = HFJreg(model, lam=lam, alpha=ALPHA, impl="torch")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(20):
            opt.zero_grad()
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            loss, _ = jreg.add_penalty(out.loss, mask)
            loss.backward()
            opt.step()
        jreg.remove()
        with torch.no_grad():
            _, psi = reference_penalty(model, norm, ids, mask, 1.0, ALPHA)
        final[lam] = float(psi[-1])
    _, psi_start = reference_penalty(model_of("llama")[0], "model.norm", ids, mask, 1.0, ALPHA)
    start = psi_start[-1].item()
    # measured (3 inits): Psi_L ~0.0003 against ~0.01 at lambda = 0 and at the start
    assert final[20.0] < 0.2 * final[0.0], (start, final)
    assert final[20.0] < 0.2 * start, (start, final)

