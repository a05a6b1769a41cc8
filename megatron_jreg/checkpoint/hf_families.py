"""The weight and config mapping of each model family's Hugging Face export and import.

megatron-core GPTModel state dict (TP1, as ``model_loader.load_model`` rebuilds it) ->
``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM`` or ``GPT2LMHeadModel``
names and config; ``to_hf`` writes the directory (docs/design.md, "Hugging Face names",
lists the names). :func:`megatron_state_dict` is the inverse, for ``from_hf``.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_jreg.errors import InputError


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> Dict[str, torch.Tensor]:
    """megatron's fused [groups * (heads/groups + 2) * d, h] QKV -> q, k, v projections."""
    # megatron's rows are grouped per key/value group g: [q heads of g; k_g; v_g]
    # (SelfAttention.get_query_key_value_tensors). HF's repeat_kv gives query head i the key
    # head i // (heads / groups), the same assignment, so q_proj is the groups' query blocks
    # in order. RoPE needs no permutation: megatron without rotary_interleaved rotates halves
    # (_rotate_half: cat(-x2, x1)) with inv_freq = base^(-2i/d), HF Llama's convention.
    per_group = num_heads // num_groups
    hidden = qkv.shape[-1]
    expected = num_groups * (per_group + 2) * head_dim
    if qkv.shape[0] != expected:
        raise ValueError(
            f"linear_qkv has {qkv.shape[0]} rows; {num_groups} groups x ({per_group} + 2) heads "
            f"x {head_dim} = {expected} expected"
        )
    grouped = qkv.reshape(num_groups, per_group + 2, head_dim, hidden)
    q = grouped[:, :per_group].reshape(num_heads * head_dim, hidden)
    k = grouped[:, per_group].reshape(num_groups * head_dim, hidden)
    v = grouped[:, per_group + 1].reshape(num_groups * head_dim, hidden)
    return {"q_proj": q.contiguous(), "k_proj": k.contiguous(), "v_proj": v.contiguous()}


class _StateReader:
    """A TP1 GPTModel state dict read key by key (``_extra_state`` entries ignored); a tensor
    no key read is an error at the end, so no weight is silently dropped."""

    SKIP = ("_extra_state",)  # key suffixes that are not weights

    def __init__(self, state: Dict[str, torch.Tensor]):
        self.state = {k: v for k, v in state.items() if not k.endswith(self.SKIP)}
        self.used = set()

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise self.missing(key)
        self.used.add(key)
        return self.state[key]

    def check_all_read(self, family: str, ignore=()) -> None:
        left = sorted(k for k in set(self.state) - self.used if k not in ignore)
        if left:
            raise self.unread(family, left[:5])

    @staticmethod
    def missing(key: str) -> Exception:
        return KeyError(f"the checkpoint's model has no {key}")

    @staticmethod
    def unread(family: str, keys) -> Exception:
        return KeyError(f"checkpoint tensors with no {family} counterpart: {keys}")


class _HFReader(_StateReader):
    """The Hugging Face side (from_hf): what is missing or left over is the user's
    files' fault, an InputError."""

    SKIP = ("rotary_emb.inv_freq",)

    @staticmethod
    def missing(key: str) -> Exception:
        return InputError(f"the Hugging Face model has no {key}; the weight files do not "
                          "match config.json")

    @staticmethod
    def unread(family: str, keys) -> Exception:
        return InputError(f"Hugging Face tensors with no {family} counterpart here: {keys}; "
                          "the model is not converted")


# GPT-2 names (megatron-core's, Hugging Face's): the same table read in both directions
_GPT2_WHOLE = (("embedding.word_embeddings.weight", "transformer.wte.weight"),
               ("embedding.position_embeddings.weight", "transformer.wpe.weight"),
               ("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
               ("decoder.final_layernorm.bias", "transformer.ln_f.bias"))
_GPT2_NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
# HF's Conv1D weights are stored [in, out]: transposed against megatron's [out, in]
_GPT2_CONV1D = (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                ("mlp.linear_fc2", "mlp.c_proj"))


def megatron_to_hf_state_dict(
    state: Dict[str, torch.Tensor], num_layers: int, num_heads: int, num_groups: int, head_dim: int,
    dense_mlp: bool = True, tied: bool = False,
) -> Dict[str, torch.Tensor]:
    """HF Llama names for a TP1 GPTModel state dict (``_extra_state`` entries ignored).
    ``dense_mlp=False``: the MLP tensors were mapped by the caller (Mixtral's experts);
    ``tied``: the output layer is the embedding (the model has no output_layer weight)."""
    take = _StateReader(state)

    out = {
        "model.embed_tokens.weight": take("embedding.word_embeddings.weight"),
        "model.norm.weight": take("decoder.final_layernorm.weight"),
    }
    out["lm_head.weight"] = (out["model.embed_tokens.weight"] if tied
                             else take("output_layer.weight"))
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "pre_mlp_layernorm.weight")
        qkv = split_qkv(
            take(src + "self_attention.linear_qkv.weight"), num_heads, num_groups, head_dim
        )
        for name, weight in qkv.items():
            out[dst + f"self_attn.{name}.weight"] = weight
        out[dst + "self_attn.o_proj.weight"] = take(src + "self_attention.linear_proj.weight")
        if not dense_mlp:
            continue
        gate, up = take(src + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.contiguous()
        out[dst + "mlp.up_proj.weight"] = up.contiguous()
        out[dst + "mlp.down_proj.weight"] = take(src + "mlp.linear_fc2.weight")
    take.check_all_read("Llama")
    return out


def llama_config_kwargs(model_cfg, padded_vocab: int) -> Dict[str, object]:
    """LlamaConfig arguments for a ModelConfig (sizes as trained, vocabulary as padded)."""
    return dict(
        vocab_size=padded_vocab,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.query_groups,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.max_positions,
        rope_theta=float(model_cfg.rotary_base),
        rms_norm_eps=float(model_cfg.norm_epsilon),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=not model_cfg.untie_embeddings_and_output_weights,
        initializer_range=float(model_cfg.init_method_std),
    )



HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def check_exportable(model_cfg) -> str:
    family = model_cfg.family
    if family not in HF_CLASSES:
        raise InputError(
            "this run's architecture has no Hugging Face family to export to (Llama, Qwen3, "
            "Mixtral and GPT-2 forms are exported; see docs/families.md); evaluate it with "
            "eval_jump --load instead")
    if model_cfg.kv_channels not in (None, model_cfg.head_dim):
        raise InputError("--kv-channels other than hidden / heads cannot be exported")
    return family


def hf_config(model_cfg, padded_vocab: int):
    """The transformers config of the run's family (sizes as trained, vocabulary as padded)."""
    import transformers

    family = check_exportable(model_cfg)
    llama = llama_config_kwargs(model_cfg, padded_vocab)
    if family == "llama":
        return transformers.LlamaConfig(**llama)
    if family == "qwen3":
        kwargs = {k: v for k, v in llama.items() if k != "mlp_bias"}
        return transformers.Qwen3Config(**kwargs, use_sliding_window=False)
    if family == "mixtral":
        kwargs = {k: v for k, v in llama.items() if k not in ("mlp_bias", "attention_bias")}
        kwargs["intermediate_size"] = model_cfg.moe_ffn_size
        return transformers.MixtralConfig(
            **kwargs, num_local_experts=model_cfg.num_experts,
            num_experts_per_tok=model_cfg.moe_router_topk,
            router_aux_loss_coef=float(model_cfg.moe_aux_loss_coeff), sliding_window=None,
            output_router_logits=False)
    return transformers.GPT2Config(
        vocab_size=padded_vocab, n_embd=model_cfg.hidden_size, n_layer=model_cfg.num_layers,
        n_head=model_cfg.num_attention_heads, n_inner=model_cfg.ffn_size,
        n_positions=model_cfg.max_positions, layer_norm_epsilon=float(model_cfg.norm_epsilon),
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        initializer_range=float(model_cfg.init_method_std), scale_attn_weights=True,
        tie_word_embeddings=not model_cfg.untie_embeddings_and_output_weights,
        bos_token_id=None, eos_token_id=None)


def hf_state_dict(state: Dict[str, torch.Tensor], model_cfg) -> Dict[str, torch.Tensor]:
    """HF names of the run's family for a TP1 GPTModel state dict."""
    family = check_exportable(model_cfg)
    heads, groups = model_cfg.num_attention_heads, model_cfg.query_groups
    head_dim = model_cfg.head_dim
    if family == "gpt2":
        return _gpt2_state_dict(state, model_cfg.num_layers, heads, head_dim,
                                tied=not model_cfg.untie_embeddings_and_output_weights)
    state = dict(state)
    extra = {}
    for i in range(model_cfg.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if family == "qwen3":
            extra[dst + "self_attn.q_norm.weight"] = state.pop(
                src + "self_attention.q_layernorm.weight")
            extra[dst + "self_attn.k_norm.weight"] = state.pop(
                src + "self_attention.k_layernorm.weight")
        if family == "mixtral":
            extra[dst + "mlp.gate.weight"] = state.pop(src + "mlp.router.weight")
            fc1, fc2 = [], []
            for e in range(model_cfg.num_experts):
                expert = src + f"mlp.experts.local_experts.{e}."
                fc1.append(state.pop(expert + "linear_fc1.weight"))
                fc2.append(state.pop(expert + "linear_fc2.weight"))
            extra[dst + "mlp.experts.gate_up_proj"] = torch.stack(fc1).contiguous()
            extra[dst + "mlp.experts.down_proj"] = torch.stack(fc2).contiguous()
    out = megatron_to_hf_state_dict(state, model_cfg.num_layers, heads, groups, head_dim,
                                    dense_mlp=family != "mixtral",
                                    tied=not model_cfg.untie_embeddings_and_output_weights)
    out.update(extra)
    return out


def _gpt2_state_dict(state: Dict[str, torch.Tensor], num_layers: int, num_heads: int,
                     head_dim: int, tied: bool = True) -> Dict[str, torch.Tensor]:
    take = _StateReader(state)

    def qkv_cat(tensor: torch.Tensor) -> torch.Tensor:  # per-head rows -> [q; k; v]
        parts = split_qkv(tensor.reshape(tensor.shape[0], -1), num_heads, num_heads, head_dim)
        return torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]]).reshape(
            -1, *tensor.shape[1:])

    out = {theirs: take(ours) for ours, theirs in _GPT2_WHOLE}
    out["lm_head.weight"] = out["transformer.wte.weight"] if tied else take("output_layer.weight")
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in _GPT2_NORMS:
            out[dst + f"{theirs}.weight"] = take(src + f"{ours}.weight")
            out[dst + f"{theirs}.bias"] = take(src + f"{ours}.bias")
        qkv_weight = take(src + "self_attention.linear_qkv.weight")
        qkv_bias = take(src + "self_attention.linear_qkv.bias")
        out[dst + "attn.c_attn.weight"] = qkv_cat(qkv_weight).t().contiguous()
        out[dst + "attn.c_attn.bias"] = qkv_cat(qkv_bias[:, None])[:, 0]
        for ours, theirs in _GPT2_CONV1D:
            out[dst + f"{theirs}.weight"] = take(src + f"{ours}.weight").t().contiguous()
            out[dst + f"{theirs}.bias"] = take(src + f"{ours}.bias")
    take.check_all_read("GPT-2")
    return out


# the model types from_hf converts, by name
FAMILY_NAMES = {"llama": "Llama", "qwen3": "Qwen3", "mixtral": "Mixtral", "gpt2": "GPT-2"}


# ---- Hugging Face -> megatron-core (from_hf) -------------------------------------------


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
              num_groups: int, head_dim: int) -> torch.Tensor:
    """q, k, v projections -> megatron's fused rows [q heads of g; k_g; v_g] per group g
    (the inverse of ``hf_families.split_qkv``); weights [rows, in] or biases [rows, 1]."""
    per_group = num_heads // num_groups
    tail = q.shape[1:]
    grouped = torch.cat([q.reshape(num_groups, per_group, head_dim, *tail),
                         k.reshape(num_groups, 1, head_dim, *tail),
                         v.reshape(num_groups, 1, head_dim, *tail)], dim=1)
    return grouped.reshape(num_groups * (per_group + 2) * head_dim, *tail).contiguous()


def _check_tied(hf_state: Dict[str, torch.Tensor], embedding: str) -> None:
    """A tied import drops ``lm_head.weight``: only right when it is the embedding."""
    head, embed = hf_state.get("lm_head.weight"), hf_state.get(embedding)
    if head is not None and embed is not None and not torch.equal(head, embed):
        raise InputError("lm_head.weight differs from the embedding " + embedding + ", so the "
                         "output layer cannot be tied to it; import it untied "
                         "(--untie-embeddings-and-output-weights)")


def megatron_state_dict(hf_state: Dict[str, torch.Tensor], model_cfg) -> Dict[str, torch.Tensor]:
    """TP1 GPTModel tensors (megatron-core's local layer spec names) for HF weights. A tied
    model (no --untie-embeddings-and-output-weights) must have lm_head equal to the
    embedding, or none: a distinct one is never dropped."""
    family = model_cfg.family
    if not model_cfg.untie_embeddings_and_output_weights:
        _check_tied(hf_state, "transformer.wte.weight" if family == "gpt2"
                    else "model.embed_tokens.weight")
    if family == "gpt2":
        return _gpt2_megatron(hf_state, model_cfg)
    take = _HFReader(hf_state)
    heads, groups, d = model_cfg.num_attention_heads, model_cfg.query_groups, model_cfg.head_dim
    tied = not model_cfg.untie_embeddings_and_output_weights
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if not tied:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(model_cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "pre_mlp_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
        out[dst + "self_attention.linear_qkv.weight"] = merge_qkv(
            take(src + "self_attn.q_proj.weight"), take(src + "self_attn.k_proj.weight"),
            take(src + "self_attn.v_proj.weight"), heads, groups, d)
        out[dst + "self_attention.linear_proj.weight"] = take(src + "self_attn.o_proj.weight")
        if family == "qwen3":
            out[dst + "self_attention.q_layernorm.weight"] = take(src + "self_attn.q_norm.weight")
            out[dst + "self_attention.k_layernorm.weight"] = take(src + "self_attn.k_norm.weight")
        if family == "mixtral":
            out[dst + "mlp.router.weight"] = take(src + "mlp.gate.weight")
            gate_up = take(src + "mlp.experts.gate_up_proj")
            down = take(src + "mlp.experts.down_proj")
            for e in range(model_cfg.num_experts):
                expert = dst + f"mlp.experts.local_experts.{e}."
                out[expert + "linear_fc1.weight"] = gate_up[e].contiguous()
                out[expert + "linear_fc2.weight"] = down[e].contiguous()
            continue
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]).contiguous()
        out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    take.check_all_read(FAMILY_NAMES.get(family, family),
                        ignore=("lm_head.weight",) if tied else ())
    return out


def _gpt2_megatron(hf_state: Dict[str, torch.Tensor], model_cfg) -> Dict[str, torch.Tensor]:
    take = _HFReader(hf_state)
    heads, d = model_cfg.num_attention_heads, model_cfg.head_dim

    def per_head(tensor: torch.Tensor) -> torch.Tensor:  # [q; k; v] rows -> per head
        flat = tensor.reshape(tensor.shape[0], -1)
        q, k, v = flat.chunk(3, dim=0)
        return merge_qkv(q, k, v, heads, heads, d).reshape(-1, *tensor.shape[1:])

    tied = not model_cfg.untie_embeddings_and_output_weights
    out = {ours: take(theirs) for ours, theirs in _GPT2_WHOLE}
    if not tied:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(model_cfg.num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for ours, theirs in _GPT2_NORMS:
            out[dst + f"{ours}.weight"] = take(src + f"{theirs}.weight")
            out[dst + f"{ours}.bias"] = take(src + f"{theirs}.bias")
        out[dst + "self_attention.linear_qkv.weight"] = per_head(
            take(src + "attn.c_attn.weight").t().contiguous())
        out[dst + "self_attention.linear_qkv.bias"] = per_head(
            take(src + "attn.c_attn.bias")[:, None])[:, 0].contiguous()
        for ours, theirs in _GPT2_CONV1D:
            out[dst + f"{ours}.weight"] = take(src + f"{theirs}.weight").t().contiguous()
            out[dst + f"{ours}.bias"] = take(src + f"{theirs}.bias")
    # the causal-mask buffers of older transformers versions are not weights
    take.check_all_read("GPT-2", ignore={k for k in hf_state if k.endswith((".attn.bias",
                                                                           ".attn.masked_bias"))}
                        | ({"lm_head.weight"} if tied else set()))
    return out
