"""Preprocessing, offline: raw text to megatron-core ``.bin``/``.idx`` datasets.

``sources`` reads inputs as line-aligned chunks, ``workers`` (``sft_workers`` for chat data,
rendered with ``chat_templates``) tokenise them in worker processes, ``writer`` writes the
indexed datasets under temporary names, ``pipeline`` runs it all, ``progress`` reports;
``demo_corpus`` writes a small offline corpus. Nothing under this package imports torch or
megatron-core, directly or through what it imports (tests/data/test_preprocess_torch_free.py):
workers start in a fraction of a second and the tools run without either installed.
"""
