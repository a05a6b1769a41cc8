"""The tokenizer types a run and the preprocessing tool accept, by name: the settings check
``--tokenizer-type`` against these; ``data.tokenizers`` builds each of them."""

from __future__ import annotations

# Megatron-LM's own types, built by ``data.tokenizers.megatron_lm``
MEGATRON_LM_TOKENIZERS = ("Llama2Tokenizer", "GPT2BPETokenizer", "NullTokenizer")

# every type ``data.tokenizers.build.build_tokenizer`` builds
TOKENIZER_TYPES = (
    "SentencePieceTokenizer", "HuggingFaceTokenizer", "ByteTokenizer", *MEGATRON_LM_TOKENIZERS
)
