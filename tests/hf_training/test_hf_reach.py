"""HFJreg's reach and traps (issue 46, item 7): hybrids whose decoder layers are of several
classes, a BART-family causal LM, StableLM with per-head norms as many as its layers, PEFT
prompt tuning, each against the definitions (JREG.md) computed from the model's own
``output_hidden_states`` (final norm taken out); an encoder-only model refused; the Trainer
taking its hooks off after train(); a second penalty() without a forward; a packed forward
that Hugging Face did not keep apart."""

import gc
import math
import weakref

import pytest
import torch
import transformers
from test_hf_penalty import batch, model_of
from test_hf_trainer import Samples

from megatron_jreg.errors import InputError
from megatron_jreg.hf_training import HFJreg, JregTrainerMixin
from megatron_jreg.ops.displacement import token_displacement_reference

SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4)

HYBRIDS = {
    # (model, the final norm's path, the layers a text-only forward skips)
    "jamba": (lambda: transformers.JambaForCausalLM(transformers.JambaConfig(
        **SMALL, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4, **SPECIAL)),
        "model.final_layernorm", ()),
    "zamba2": (lambda: transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        **SMALL, num_key_value_heads=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=4, mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1, num_mem_blocks=1,
        use_mem_rope=False, adapter_rank=4, use_shared_attention_adapter=False, **SPECIAL)),
        "model.final_layernorm", ()),
    "olmo_hybrid": (lambda: transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(
        **SMALL, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2,
        **SPECIAL)), "model.norm", ()),
    # Mllama's text model skips its cross-attention layer (index 1) without an image
    "mllama": (lambda: transformers.MllamaForCausalLM(transformers.MllamaTextConfig(
        **SMALL, num_key_value_heads=2, cross_attention_layers=[1], **SPECIAL)),
        "model.norm", (1,)),
    # 2 layers of 2 sub-blocks each; its config's num_hidden_layers says 4
    "longcat_flash": (lambda: transformers.LongcatFlashForCausalLM(transformers.LongcatFlashConfig(
        vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
        ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=4, moe_topk=2,
        zero_expert_num=1, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16,
        q_lora_rank=16, head_dim=8, **SPECIAL)), "model.norm", ()),
}


def reference(model, norm_path, ids, mask, lam, alpha, skipped=(), real=None, **forward):
    """(lam * sum_l softmax(alpha l)_l Psi_l, Psi) from output_hidden_states with the final
    norm replaced by the identity; a layer in ``skipped`` did not run (h_l = h_{l-1});
    ``real`` the tokens counted (default ``mask``)."""
    owner_path, _, name = norm_path.rpartition(".")
    owner = model.get_submodule(owner_path)
    norm = getattr(owner, name)
    setattr(owner, name, torch.nn.Identity())
    try:
        states = list(model(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                            **forward).hidden_states)
    finally:
        setattr(owner, name, norm)
    for index in sorted(skipped):
        states.insert(index + 1, states[index])
    real = (mask if real is None else real).bool()
    psi = torch.stack([token_displacement_reference(a, b)[real].mean()
                       for a, b in zip(states[:-1], states[1:])])
    weights = torch.tensor([math.exp(alpha * l) for l in range(1, len(psi) + 1)])
    return lam * (weights / weights.sum() * psi).sum(), psi


def assert_penalty_is_the_reference(model, jreg, ids, mask, norm, skipped=(), real=None,
                                    forward=None, penalty_mask="same"):
    forward = forward or {}
    model.zero_grad()
    model(input_ids=ids, attention_mask=mask, **forward)
    got = jreg.penalty(mask if penalty_mask == "same" else penalty_mask)
    got["penalty"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    jreg.remove()
    model.zero_grad()
    want, psi = reference(model, norm, ids, mask, 0.7, 1.0, skipped, real, **forward)
    want.backward()
    torch.testing.assert_close(got["psi"], psi.detach().float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["penalty"].detach(), want.detach().float(), rtol=1e-5, atol=1e-7)
    assert grads and set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    return got


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_a_hybrid_stack_gives_the_penalty_of_the_definitions(name):
    build, norm, skipped = HYBRIDS[name]
    torch.manual_seed(0)
    model = build().float().eval()
    jreg = HFJreg(model, lam=0.7, alpha=1.0, impl="torch")
    assert jreg.path == "model.layers" and jreg.num_layers == len(model.model.layers)
    ids, mask = batch()
    got = assert_penalty_is_the_reference(model, jreg, ids, mask, norm, skipped)
    for index in skipped:
        assert float(got["psi"][index]) == 0.0


def test_a_layer_that_did_not_run_is_refused_unless_its_neighbours_pass_the_state_on():
    """A layer without a record counts as h_l = h_{l-1} only when the next layer that ran got
    the very tensor the previous one returned (Mllama's skip); a forward that ran only some
    layers otherwise says how many were recorded."""
    model, _ = model_of("llama")
    jreg = HFJreg(model, impl="torch")
    ids, mask = batch()
    model(input_ids=ids, attention_mask=mask)
    del jreg._pairs[2]  # as if layer 2 had not run, but layer 3 got layer 2's output
    with pytest.raises(RuntimeError, match=r"^HFJreg.penalty: 2 of 3 layers were recorded"):
        jreg.penalty(mask)


@pytest.mark.parametrize("family", ["bart", "mbart"])
def test_a_bart_family_causal_lm_uses_its_decoder_layers(family):
    torch.manual_seed(0)
    config = dict(vocab_size=97, d_model=16, encoder_layers=3, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                  decoder_ffn_dim=32, dropout=0.0, **SPECIAL)
    if family == "bart":
        model = transformers.BartForCausalLM(transformers.BartConfig(**config))
        norm = None  # post-norm layers: no final norm
    else:
        model = transformers.MBartForCausalLM(transformers.MBartConfig(**config))
        norm = "model.decoder.layer_norm"
    model.eval()
    jreg = HFJreg(model, lam=0.7, alpha=1.0, impl="torch")
    assert jreg.path == "model.decoder.layers" and jreg.num_layers == 2
    ids, mask = batch()
    if norm is None:  # an identity stands in, so the reference code runs unchanged
        model.model.decoder.add_module("no_final_norm", torch.nn.Identity())
        norm = "model.decoder.no_final_norm"
    assert_penalty_is_the_reference(model, jreg, ids, mask, norm)


def test_stablelm_with_per_head_norms_as_many_as_its_layers():
    torch.manual_seed(0)
    model = transformers.StableLmForCausalLM(transformers.StableLmConfig(
        **SMALL, num_key_value_heads=4, qk_layernorm=True, hidden_dropout=0.0)).eval()
    lists = [p for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
             and len(m) == 4]
    assert len(lists) > 1  # the per-head norms are lists of 4 too
    jreg = HFJreg(model, lam=0.7, alpha=1.0, impl="torch")
    assert jreg.path == "model.layers"
    ids, mask = batch()
    assert_penalty_is_the_reference(model, jreg, ids, mask, "model.norm")


@pytest.mark.parametrize("build", [
    lambda: transformers.BertModel(transformers.BertConfig(**SMALL)),
    lambda: transformers.RobertaModel(transformers.RobertaConfig(**SMALL)),
    lambda: transformers.BertLMHeadModel(transformers.BertConfig(**SMALL)),  # not is_decoder
    lambda: transformers.DebertaV2Model(transformers.DebertaV2Config(**SMALL)),
])
def test_an_encoder_only_model_is_refused(build):
    model = build()
    with pytest.raises(InputError, match=rf"^{type(model).__name__} is not a causal LM \(.*\); "
                                         "JREG here is for causal LMs: give one"):
        HFJreg(model)
    assert not any(layer._forward_hooks for layer in model.modules())


def test_a_bert_built_as_a_decoder_is_a_causal_lm():
    model = transformers.BertLMHeadModel(transformers.BertConfig(**SMALL, is_decoder=True))
    assert HFJreg(model).path == "bert.encoder.layer"


class JregTrainer(JregTrainerMixin, transformers.Trainer):
    pass


def _args(tmp_path, steps=1):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0)


def _hooked(model):
    return [name for name, module in model.named_modules()
            if module._forward_hooks or module._forward_pre_hooks]


def test_after_train_the_hooks_are_off_and_no_hidden_state_stays_referenced(tmp_path):
    model, _ = model_of("llama")
    ids, mask = batch()
    trainer = JregTrainer(model=model.train(), args=_args(tmp_path),
                          train_dataset=Samples(ids, mask), jreg_lambda=0.5, jreg_impl="torch")
    for run in range(2):  # a second train() puts the hooks back and regularizes again
        trainer.train()
        log = [row for row in trainer.state.log_history if "loss" in row][-1]
        assert math.isfinite(log["jreg_penalty"]) and log["jreg_penalty"] > 0, run
        assert _hooked(trainer.model) == [], run
        # a forward after training (generation, a metric) leaves nothing referenced
        seen = []
        probe = trainer.model.model.layers[1].register_forward_hook(
            lambda module, args, output, seen=seen: seen.append(weakref.ref(output)))
        with torch.no_grad():
            trainer.model(input_ids=ids, attention_mask=mask)
        probe.remove()
        gc.collect()
        assert seen and seen[0]() is None, run
        assert not trainer.jreg._pairs


def test_a_second_penalty_without_a_forward_says_the_first_used_the_layers():
    model, _ = model_of("llama")
    jreg = HFJreg(model, impl="torch")
    ids, mask = batch()
    model(input_ids=ids, attention_mask=mask)
    jreg.penalty(mask)
    with pytest.raises(RuntimeError, match=r"^HFJreg.penalty: the recorded layers were already "
                                           r"used by the previous penalty\(\) call; run a "
                                           r"forward of the model before each penalty\(\) call$"):
        jreg.penalty(mask)
    model(input_ids=ids, attention_mask=mask)
    assert math.isfinite(float(jreg.penalty(mask)["R"]))


def _packed():
    """Two rows, each two sequences of 5 and 4 tokens packed (position_ids restart)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (2, 9), generator=gen)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)]).expand(2, 9)
    return ids, position_ids


def test_a_packed_forward_that_hugging_face_does_not_separate_is_refused():
    model, _ = model_of("llama")
    jreg = HFJreg(model, impl="torch")
    ids, position_ids = _packed()
    # use_cache left on: Hugging Face lets the second sequence attend to the first
    apart = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    together = model(input_ids=ids, position_ids=position_ids).logits
    assert not torch.allclose(apart[:, 5:], together[:, 5:], atol=1e-4)
    with pytest.raises(InputError, match=r"^HFJreg.penalty: the forward packed several sequences "
                                         r"in a row \(position_ids restart\) but the model kept a "
                                         r"cache, .*; pass use_cache=False to the forward$"):
        jreg.penalty()
    model(input_ids=ids, position_ids=position_ids, attention_mask=torch.ones_like(ids),
          use_cache=False)
    with pytest.raises(InputError, match=r"but the forward was given an attention_mask"):
        jreg.penalty()


def test_a_packed_forward_kept_apart_gives_the_psi_of_its_sequences_run_alone():
    model, norm = model_of("llama")
    jreg = HFJreg(model, lam=0.7, alpha=1.0, impl="torch")
    ids, position_ids = _packed()
    model(input_ids=ids, position_ids=position_ids, use_cache=False)
    got = jreg.penalty()
    jreg.remove()
    # reference: each sequence alone, the token mean over all of them
    per_token = []
    owner = model.model
    final = owner.norm
    owner.norm = torch.nn.Identity()
    try:
        with torch.no_grad():
            for part in (ids[:, :5], ids[:, 5:]):
                states = model(input_ids=part, output_hidden_states=True).hidden_states
                per_token.append(torch.stack([token_displacement_reference(a, b)
                                              for a, b in zip(states[:-1], states[1:])]))
    finally:
        owner.norm = final
    psi = torch.cat(per_token, dim=-1).flatten(1).mean(-1)  # [L]
    torch.testing.assert_close(got["psi"], psi.float(), rtol=1e-5, atol=1e-6)


def test_left_padding_with_its_position_ids_is_not_taken_for_packing():
    model, _ = model_of("llama")
    jreg = HFJreg(model, impl="torch")
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() makes them
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids)
    assert math.isfinite(float(jreg.penalty(mask)["R"]))


def _prompt_tuned(virtual=4):
    peft = pytest.importorskip("peft")
    model, _ = model_of("llama")
    base = model
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=virtual)
    return peft.get_peft_model(model, config), base


def test_prompt_tuning_counts_the_virtual_tokens_as_real():
    """The mask the caller has covers the text (9 positions); the layers see 4 virtual tokens
    before it, which the model attends to (PEFT's mask marks them 1) and every layer moves:
    they count, as the reference over the model's own mask says."""
    model, base = _prompt_tuned()
    jreg = HFJreg(model, lam=0.7, alpha=1.0, impl="torch")
    ids, mask = batch()
    real = torch.cat([torch.ones(2, 4, dtype=mask.dtype), mask], dim=1)
    model.zero_grad()
    model(input_ids=ids, attention_mask=mask)
    got = jreg.penalty(mask)
    got["penalty"].backward()
    grad = model.prompt_encoder.default.embedding.weight.grad.clone()
    jreg.remove()
    model.zero_grad()
    want, psi = reference(model, "base_model.model.norm", ids, mask, 0.7, 1.0, real=real)
    want.backward()
    torch.testing.assert_close(got["psi"], psi.detach().float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["penalty"].detach(), want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, model.prompt_encoder.default.embedding.weight.grad,
                               rtol=1e-4, atol=1e-7)
    assert float(grad.abs().sum()) > 0


def test_a_mask_that_does_not_fit_the_forward_is_one_line():
    model, _ = model_of("llama")
    jreg = HFJreg(model, impl="torch")
    ids, mask = batch()
    model(input_ids=ids, attention_mask=mask)
    with pytest.raises(InputError, match=r"^HFJreg.penalty: attention_mask has shape \(2, 7\) but "
                                         r"the layers' hidden states have \(2, 9\) tokens"):
        jreg.penalty(mask[:, :7])


def test_every_trainer_step_on_a_prompt_tuned_model_works(tmp_path):
    model, base = _prompt_tuned()
    ids, mask = batch()
    trainer = JregTrainer(model=model.train(), args=_args(tmp_path, steps=2),
                          train_dataset=Samples(ids, mask), jreg_lambda=0.5, jreg_impl="torch")
    before = model.prompt_encoder.default.embedding.weight.detach().clone()
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2 and all(math.isfinite(row["jreg_penalty"]) and row["jreg_penalty"] > 0
                                  for row in logs)
    assert not torch.equal(before, model.prompt_encoder.default.embedding.weight)
