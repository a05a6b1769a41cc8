"""Data, in three parts by when they run:

- ``preprocess``: raw text to indexed ``.bin``/``.idx`` datasets, offline
  (``tools/preprocess_data.py``, the demo corpus). Imports neither torch nor megatron-core.
- ``tokenizers``: the tokenizers preprocessing, the trainer and eval_jump share, and
  tokenizer training (``tools/train_tokenizer.py``). Imports neither torch nor megatron-core.
- ``datasets``: what a training run reads: GPT and SFT datasets, the sample order, the
  micro-batches, the ``--data-path`` blend and the run's data check.

Nothing is imported here: a module of one part costs no import of another.
"""
