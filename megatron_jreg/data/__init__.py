"""Data: tokenizers, raw text to indexed datasets, and GPT datasets for training.

Kept import-light: megatron-core is imported only by the modules that write or read datasets.
"""

from megatron_jreg.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

__all__ = ["TOKENIZER_TYPES", "build_tokenizer"]
