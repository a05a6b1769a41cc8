"""Preprocessing, offline: raw text to megatron-core ``.bin``/``.idx`` datasets.

``pipeline`` runs it with the settings of ``config``: ``sources`` reads line-aligned chunks
(``compressed``: gzip and zstd), ``workers`` (``sft_workers`` for chat data, rendered with
``chat_templates``) tokenise them in processes that end with their parent (``parent_death``),
``writer`` writes the datasets (``sft_files``: an SFT dataset's files), ``progress`` reports;
``demo_corpus`` writes a small offline corpus. Nothing here imports torch or megatron-core
(tests/data/test_preprocess_torch_free.py): neither the tool nor its workers pay for them.
"""
