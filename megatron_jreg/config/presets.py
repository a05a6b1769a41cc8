"""Model presets as bundles of Megatron-LM's flags, and Megatron-LM's architecture defaults.

Data only (no imports of the package): ``model.config`` reads the bundles with the model
flags' own parser, so ``--model-preset 3b`` is exactly the flags it stands for.
"""

# The Llama form, as Megatron-LM's Llama examples write it. The Llama presets carry it.
LLAMA_FLAGS = ("--swiglu --normalization RMSNorm --position-embedding-type rope "
               "--untie-embeddings-and-output-weights --disable-bias-linear "
               "--attention-dropout 0.0 --hidden-dropout 0.0 --attention-softmax-in-fp32")

# The other families' forms (docs/families.md). GPT-2 is Megatron-LM's defaults (LayerNorm,
# GeLU, learned positions, biases, tied embeddings): its bundle only sets what differs.
_NO_DROPOUT = "--attention-dropout 0.0 --hidden-dropout 0.0"
FAMILY_FLAGS = {
    "llama": LLAMA_FLAGS,
    "gpt2": f"--normalization LayerNorm --position-embedding-type learned_absolute {_NO_DROPOUT}",
    "qwen3": f"{LLAMA_FLAGS} --qk-layernorm --rotary-base 1000000",
    "mixtral": f"{LLAMA_FLAGS} --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.01",
}

# Presets: named bundles of flags (a size and a family's form); flags or YAML override any
# of them. Heads, FFN, query groups and sequence length are ours (the paper gives layers
# and hidden size): head dim 64 at 170m, 128 above; FFN = 8/3 hidden rounded up to 256.
# Parameters at a 32000-token vocab: 170m 134M, 1b 0.95B, 3b 3.6B (3.4B without the untied
# output layer). --max-position-embeddings is left out: it follows --seq-length.
_GQA = "--group-query-attention --num-query-groups"
_TINY = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128"
PRESETS_BY_FAMILY = {
    "tiny": ("llama", f"{_TINY} {_GQA} 2 --ffn-hidden-size 192"),
    "170m": ("llama", f"--num-layers 12 --hidden-size 768 --num-attention-heads 12 {_GQA} 12 "
                      "--ffn-hidden-size 2048 --seq-length 2048"),
    "1b": ("llama", f"--num-layers 16 --hidden-size 2048 --num-attention-heads 16 {_GQA} 8 "
                    "--ffn-hidden-size 5632 --seq-length 2048"),
    "3b": ("llama", f"--num-layers 30 --hidden-size 3072 --num-attention-heads 24 {_GQA} 8 "
                    "--ffn-hidden-size 8192 --seq-length 2048"),
    # the tiny size in each other family (CPU runs; examples/jreg_across_families.sh)
    "gpt2-tiny": ("gpt2", f"{_TINY} --ffn-hidden-size 256"),
    "qwen3-tiny": ("qwen3", f"{_TINY} {_GQA} 2 --ffn-hidden-size 192"),
    "mixtral-tiny": ("mixtral", f"{_TINY} {_GQA} 2 --ffn-hidden-size 96"),
}
PRESET_FLAGS = {name: sizes for name, (_, sizes) in PRESETS_BY_FAMILY.items()}

# Megatron-LM's defaults where ours are the Llama form. Without --model-preset, settings
# that size the model (the flags Megatron-LM requires) are read as Megatron-LM reads them:
# what they leave out takes these values, so the model is the one Megatron-LM would build
# (or is refused by name when JREG cannot build it yet).
MEGATRON_LM_MODEL_DEFAULTS = dict(
    swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
    untie_embeddings_and_output_weights=False, add_bias_linear=True, group_query_attention=False,
    num_query_groups=1, hidden_dropout=0.1, attention_dropout=0.1, attention_softmax_in_fp32=False)
SIZING = ("num_layers", "hidden_size", "num_attention_heads")


def preset_flags(preset: str) -> list:
    """The flags ``--model-preset PRESET`` stands for."""
    family, sizes = PRESETS_BY_FAMILY[preset]
    return (sizes + " " + FAMILY_FLAGS[family]).split()
