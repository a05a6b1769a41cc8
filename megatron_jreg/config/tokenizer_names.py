"""The tokenizer types a run and the preprocessing tool accept, by name: the settings check
``--tokenizer-type`` against these (``tokenizer_type_error``); ``data.tokenizers`` builds
each of them."""

from __future__ import annotations

# Megatron-LM's own types, built by ``data.tokenizers.megatron_lm``
MEGATRON_LM_TOKENIZERS = ("Llama2Tokenizer", "GPT2BPETokenizer", "NullTokenizer")

# sentencepiece models (``data.tokenizers.build.SentencePieceTokenizer``): both give the
# model's ids by default, as Megatron-LM core_v0.16.1 does; SentencePieceTokenizer's
# vocabulary counts Megatron-LM's legacy special tokens, which --legacy-tokenizer splits out
SENTENCEPIECE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")

# every type ``data.tokenizers.build.build_tokenizer`` builds
TOKENIZER_TYPES = (
    *SENTENCEPIECE_TOKENIZERS, "HuggingFaceTokenizer", "ByteTokenizer", *MEGATRON_LM_TOKENIZERS
)

# Megatron-LM core_v0.16.1's other --tokenizer-type names, and what to use here instead
UNSUPPORTED_MEGATRON_LM_TOKENIZERS = {
    "BertWordPieceLowerCase": "BERT models are not trained here; for a GPT model use "
                              "HuggingFaceTokenizer with the tokenizer's directory",
    "BertWordPieceCase": "BERT models are not trained here; for a GPT model use "
                         "HuggingFaceTokenizer with the tokenizer's directory",
    "TikTokenizer": "use HuggingFaceTokenizer with a tokenizer.json of the same vocabulary",
    "MultimodalTokenizer": "text only here: use HuggingFaceTokenizer",
    "NullMultimodalTokenizer": "text only here: use NullTokenizer",
    "SFTTokenizer": "use HuggingFaceTokenizer with preprocess_data.py --sft (docs/sft.md)",
}


def tokenizer_type_error(name: str) -> str | None:
    """The one-line message for a ``--tokenizer-type`` not built here, naming the type to
    use; None for a type that is built."""
    if name in TOKENIZER_TYPES:
        return None
    if name in UNSUPPORTED_MEGATRON_LM_TOKENIZERS:
        return (f"--tokenizer-type {name} (Megatron-LM's) is not supported here: "
                f"{UNSUPPORTED_MEGATRON_LM_TOKENIZERS[name]}")
    return f"--tokenizer-type {name!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}"
