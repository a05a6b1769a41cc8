"""HFJreg's penalty and its gradient against the definitions (JREG.md) computed from the
model's own hidden states, for several architectures: the states come from
``output_hidden_states`` with the final norm taken out (so ``h_L`` is the last layer's
output, before the norm), the displacement from the PyTorch reference, the weights from the
softmax formula written out. Padded positions change nothing."""

import math

import pytest
import torch
import transformers

from megatron_jreg.errors import InputError
from megatron_jreg.hf_training import HFJreg, decoder_layers
from megatron_jreg.ops.displacement import token_displacement_reference

ARCHS = {
    # (config, the final norm's attribute path)
    "llama": (lambda: transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2), "model.norm"),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             "transformer.ln_f"),  # no dropout: a training step is then deterministic
    "gemma3": (lambda: transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8), "model.norm"),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4), "gpt_neox.final_layer_norm"),
}


def model_of(arch):
    torch.manual_seed(0)
    config, norm = ARCHS[arch]
    model = transformers.AutoModelForCausalLM.from_config(config(), dtype=torch.float32)
    return model.eval(), norm


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # the second row is 6 tokens, right-padded
    return ids, mask


def reference_penalty(model, norm_path, ids, mask, lam, alpha):
    """lam * sum_l softmax(alpha l)_l * Psi_l from output_hidden_states, final norm removed."""
    owner_path, _, name = norm_path.rpartition(".")
    owner = model.get_submodule(owner_path)
    norm = getattr(owner, name)
    setattr(owner, name, torch.nn.Identity())
    try:
        states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    finally:
        setattr(owner, name, norm)
    real = mask.bool()
    psi = torch.stack([token_displacement_reference(a, b)[real].mean()
                       for a, b in zip(states[:-1], states[1:])])
    L = len(psi)
    weights = torch.tensor([math.exp(alpha * l) for l in range(1, L + 1)], dtype=psi.dtype)
    weights = weights / weights.sum()
    return lam * (weights * psi).sum(), psi


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_penalty_and_gradient_equal_the_definitions(arch):
    model, norm = model_of(arch)
    ids, mask = batch()
    jreg = HFJreg(model, lam=0.7, alpha=1.0, impl="torch")
    model(input_ids=ids, attention_mask=mask)
    got = jreg.penalty(mask)
    got["penalty"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    jreg.remove()
    assert_reference(model, norm, ids, mask, got, grads)


def assert_reference(model, norm, ids, mask, got, grads, lam=0.7):
    """``got`` (HFJreg.penalty's values) and ``grads`` (its gradients) equal the reference
    penalty's on ``model`` (whose .grad this clears first)."""
    model.zero_grad()
    want, psi = reference_penalty(model, norm, ids, mask, lam, 1.0)
    want.backward()
    torch.testing.assert_close(got["psi"], psi.detach().float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["penalty"].detach(), want.detach().float(), rtol=1e-5, atol=1e-7)
    assert grads, "the penalty has no gradient"
    assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    return psi


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_padded_positions_change_nothing(arch):
    model, _ = model_of(arch)
    ids, mask = batch()
    other = ids.clone()
    other[1, 6:] = (ids[1, 6:] + 5) % 97  # other pad ids: other hidden states there
    jreg = HFJreg(model, impl="torch")
    values = []
    for tokens in (ids, other):
        model.zero_grad()
        model(input_ids=tokens, attention_mask=mask)
        out = jreg.penalty(mask)
        out["penalty"].backward()
        values.append((out["penalty"].detach(), [p.grad.clone() for p in model.parameters()
                                                 if p.grad is not None]))
    assert torch.equal(values[0][0], values[1][0])
    for a, b in zip(values[0][1], values[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_the_decoder_layers_are_found_from_the_model_itself():
    model, _ = model_of("gpt_neox")
    path, layers = decoder_layers(model)
    assert path == "gpt_neox.layers" and len(layers) == 3

    class NoLayers(torch.nn.Module):
        config = transformers.LlamaConfig(num_hidden_layers=4)

    with pytest.raises(InputError, match="NoLayers: cannot tell its decoder layers: outermost "
                                         "lists of 4 layers .its config's layer count. "
                                         "found: none"):
        decoder_layers(NoLayers())


def test_a_real_checkpoint_smollm2(smollm2_hf):
    """SmolLM2-135M-Instruct (30 layers, dequantized from its GGUF): the penalty and Psi of
    the hooks equal the definitions'; a real model jumps at its last layer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf,
                                                              dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    enc = tokenizer(["The capital of France is Paris.", "Water boils at"], return_tensors="pt",
                    padding=True)
    jreg = HFJreg(model, lam=1.0, alpha=1.0, impl="torch")
    with torch.no_grad():
        model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        got = jreg.penalty(enc["attention_mask"])
        jreg.remove()
        want, psi = reference_penalty(model, "model.norm", enc["input_ids"],
                                      enc["attention_mask"], 1.0, 1.0)
    torch.testing.assert_close(got["psi"], psi.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["penalty"], want.float(), rtol=1e-5, atol=1e-7)
    assert len(psi) == 30 and jreg.rates(got["psi"])["zeta_L"] > 1.0


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradient_checkpointing_gives_the_same_penalty_and_gradient(arch, reentrant):
    """The layers' forwards run again inside backward: those passes are not recorded, and the
    recorded pairs carry the gradient through the checkpoint."""
    import copy

    model, _ = model_of(arch)
    ids, mask = batch()
    results = []
    for checkpointing in (False, True):
        m = copy.deepcopy(model).train()
        if checkpointing:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        jreg = HFJreg(m, impl="torch")
        m(input_ids=ids, attention_mask=mask)
        penalty = jreg.penalty(mask)["penalty"]
        penalty.backward()
        results.append((penalty.detach(), {n: p.grad for n, p in m.named_parameters()
                                           if p.grad is not None}))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = results
    torch.testing.assert_close(checkpointed, plain, rtol=1e-6, atol=0)
    assert plain_grads and set(checkpointed_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_no_grad_forward_between_keeps_the_training_forwards_pairs():
    """A trainer that recomputes logits under no_grad after the training forward (TRL did,
    before the penalty was read) must not replace the pairs that carry the graph."""
    model, norm = model_of("llama")
    ids, mask = batch()
    jreg = HFJreg(model, lam=0.7, impl="torch")
    model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        model(input_ids=(ids + 3) % 97, attention_mask=mask)  # other tokens, no graph
    got = jreg.penalty(mask)
    got["penalty"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    jreg.remove()
    psi = assert_reference(model, norm, ids, mask, got, grads)
    # after the penalty is read, a no_grad forward is recorded (evaluation)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        jreg2 = HFJreg(model, lam=0.7, impl="torch")
        model(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(jreg2.penalty(mask)["psi"], psi.float(), rtol=1e-5, atol=1e-7)
