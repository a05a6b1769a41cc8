"""Preprocessing, offline: raw text to megatron-core ``.bin``/``.idx`` datasets.

``sources`` reads inputs as line-aligned chunks (``compressed``: gzip and zstd), ``workers`` (``sft_workers`` for chat data,
rendered with ``chat_templates``) tokenise them in worker processes that end with their
parent (``parent_death``), ``writer`` writes the indexed datasets under temporary names
(``sft_files``: an SFT dataset's file names and metadata), ``pipeline`` runs it all with the
settings of ``config``, ``progress`` reports; ``demo_corpus`` writes a small offline corpus.

Nothing under this package imports torch or megatron-core, directly or through what it
imports (tests/data/test_preprocess_torch_free.py): neither the tool nor its workers pay the
seconds those imports take.
"""
