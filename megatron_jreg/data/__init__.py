"""Data: tokenizers, raw text to indexed datasets, and GPT datasets for training.

Kept import-light: megatron-core is imported only by the modules that read datasets for
training; preprocessing writes the format itself (``indexed_writer``).
"""

from megatron_jreg.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

__all__ = ["TOKENIZER_TYPES", "build_tokenizer"]
