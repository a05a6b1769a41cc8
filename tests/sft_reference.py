"""SFT test conversations, and what the tulu template, the byte tokenizer and next-token
training make of them, written out by hand from their definitions (nothing of the
package's SFT code is used):

- the tulu format: ``<|system|>\\n{content}\\n``, ``<|user|>\\n{content}\\n``,
  ``<|assistant|>\\n{content}{eos}\\n``;
- the byte tokenizer: a text's UTF-8 bytes, its EOS (``<|eod|>`` in a template) id 256;
- the loss mask: 1 on each assistant message's content and the EOS that ends it;
- a training sample of ``seq_length`` positions: position ``p`` reads token ``p`` of the
  conversation and is trained to predict token ``p + 1``, so it counts in the loss exactly
  when token ``p + 1`` is in the loss mask; positions with no next token are padding.

``run_sft`` runs the code under test (``preprocess_data.py --sft``, in-process).
"""

import numpy

BYTE_EOS, BYTE_EOS_TEXT = 256, "<|eod|>"

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "The quick brown fox?"},
     {"role": "assistant", "content": "Jumps over the lazy dog."}],
    [{"role": "user", "content": "Unicode please.", "name": "ignored field"},
     {"role": "assistant", "content": "café, naïve, 東京, emoji 🙂"},
     {"role": "user", "content": "Digits?"},
     {"role": "assistant", "content": "12345 and 678."}],
    [{"role": "user", "content": "Spaces and lines."},
     {"role": "assistant", "content": " Sure.\nLine two.  "}],
    [{"role": "user", "content": "Say nothing."},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "Now say hi."},
     {"role": "assistant", "content": "Hi."},
     {"role": "user", "content": "Thanks."},
     {"role": "assistant", "content": "Tokenizers split text into pieces."}],
]


def tulu_parts(messages, eos):
    """The tulu rendering as (text, loss-masked) parts: the documented format by hand."""
    header = {"system": "<|system|>\n", "user": "<|user|>\n", "assistant": "<|assistant|>\n"}
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            parts += [(header["assistant"], 0), (m["content"] + eos, 1), ("\n", 0)]
        else:
            parts.append((header[m["role"]] + m["content"] + "\n", 0))
    return parts


def tulu_text(messages, eos):
    return "".join(text for text, _ in tulu_parts(messages, eos))


def byte_tulu(messages):
    """(token ids, 0/1 loss mask) of a conversation rendered with tulu, byte tokenizer."""
    ids, mask = [], []

    def put(tokens, masked):
        ids.extend(tokens)
        mask.extend([masked] * len(tokens))

    for m in messages:
        put(f"<|{m['role']}|>\n".encode(), 0)
        if m["role"] == "assistant":
            put(m["content"].encode(), 1)
            put([BYTE_EOS], 1)
            put(b"\n", 0)
        else:
            put((m["content"] + "\n").encode(), 0)
    return ids, mask


def reference_sample(ids, mask, seq_length, pad_id):
    """One training sample of a conversation, position by position (numpy arrays)."""
    tokens = numpy.full(seq_length, pad_id, dtype=numpy.int64)
    labels = numpy.full(seq_length, pad_id, dtype=numpy.int64)
    loss_mask = numpy.zeros(seq_length, dtype=numpy.float32)
    token_mask = numpy.zeros(seq_length, dtype=bool)
    for p in range(seq_length):
        target = p + 1
        if target >= len(ids):
            continue  # no next token: padding
        tokens[p], labels[p] = ids[p], ids[target]
        loss_mask[p] = 1.0 if mask[target] else 0.0
        token_mask[p] = True
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "token_mask": token_mask}


def sample_order(sample, num_conversations, seed):
    """The conversation (index into a split that starts at conversation 0) of ``sample``:
    each epoch ``e`` reads the split in the order of numpy's seeded permutation ``seed + e``."""
    epoch, position = divmod(sample, num_conversations)
    return int(numpy.random.RandomState(seed + epoch).permutation(num_conversations)[position])


def run_sft(tmp_path, records, *flags, name="out"):
    """``preprocess_data.py --sft`` in-process on ``records`` (conversations, dicts or raw
    lines); returns (exit code, input path, output prefix)."""
    from preprocess_helpers import write_jsonl

    from megatron_jreg.commands.preprocess import main

    data = write_jsonl(tmp_path / f"{name}.jsonl", [
        {"messages": r, "id": i} if isinstance(r, list) else r for i, r in enumerate(records)])
    prefix = str(tmp_path / name)
    return main(["--sft", "--input", data, "--output-prefix", prefix, *flags]), data, prefix
