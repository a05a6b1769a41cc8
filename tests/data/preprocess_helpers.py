"""Helpers shared by the data tests (a unique module name, importable from tests/data)."""

import json
import os

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container; raise TypeError otherwise.",
    "Tokenizers split text into pieces, and pieces map to integer ids.",
    "A checkpoint holds the model weights and the optimizer state at one step.",
    "Unicode text: café, naïve, 東京, emoji 🙂 and digits 12345.",
]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


def make_documents(n, seed=0):
    """n varied documents of 1-6 sentences, deterministic."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 6))) + f" #{i}"
            for i in range(n)]


def output_files(directory):
    """Everything the tool left in ``directory`` besides inputs (*.jsonl, *.txt, *.gz)."""
    return sorted(n for n in os.listdir(directory)
                  if not n.endswith((".jsonl", ".txt", ".gz", ".model", ".vocab", ".json")))
