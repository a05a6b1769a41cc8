"""Tokenizers: ``build`` (the one interface, and the types this project builds),
``megatron_lm`` (Megatron-LM's types), ``token_arrays`` (packed ids, file hashes) and
``training`` (``tools/train_tokenizer.py``). Imports neither torch nor megatron-core:
preprocessing workers import them."""
