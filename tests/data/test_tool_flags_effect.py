"""What the flags of train_tokenizer.py and make_demo_corpus.py change in what they write.

The tokenizer tests read the trained sentencepiece model back (its pieces, scores and the
trainer settings it records); the corpus test compares two runs of the tool, one that
keeps every docstring and one that drops the short ones.
"""

import json
import os
import random
import runpy
import subprocess
import sys

import pytest
from preprocess_helpers import write_jsonl

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")

pytest.importorskip("sentencepiece")


def tool_main(name):
    return runpy.run_path(os.path.join(TOOLS, name), run_name="not_main")["main"]


def pseudo_words(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice("aeioubdfgklmnprst") for _ in range(rng.randint(3, 8)))
            for _ in range(n)]


def train(tmp_path, name, inputs, *flags, vocab_size=300):
    """Train with the tool's main(); the model as a SentencePieceProcessor and its proto."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    prefix = str(tmp_path / name)
    argv = ["--input", *map(str, inputs), "--model-prefix", prefix,
            "--vocab-size", str(vocab_size), *map(str, flags)]
    assert tool_main("train_tokenizer.py")(argv) == 0
    proto = sentencepiece_model_pb2.ModelProto()
    with open(prefix + ".model", "rb") as f:
        proto.ParseFromString(f.read())
    return sentencepiece.SentencePieceProcessor(model_file=prefix + ".model"), proto


def is_piece(sp, piece):
    return sp.piece_to_id(piece) != sp.unk_id()


# ---- train_tokenizer.py --------------------------------------------------------------------

MARK_A, MARK_B = "kavorit", "zumbelo"  # a word only field "a" holds, and one only "b" holds


@pytest.fixture(scope="module")
def two_fields(tmp_path_factory):
    """150 records {"a", "b"}: each field a line of its own word and five common ones."""
    rng = random.Random(0)
    words = pseudo_words(80, seed=0)
    assert not {MARK_A, MARK_B} & set(words)
    records = [{"a": " ".join([MARK_A] + rng.choices(words, k=6)),
                "b": " ".join([MARK_B] + rng.choices(words, k=6))} for _ in range(150)]
    return write_jsonl(tmp_path_factory.mktemp("fields") / "fields.jsonl", records)


@pytest.mark.parametrize("keys,learned,unseen", [
    (["a"], [MARK_A], [MARK_B]),
    (["b"], [MARK_B], [MARK_A]),
    (["a", "b"], [MARK_A, MARK_B], []),
])
def test_json_keys_select_the_fields_read(two_fields, tmp_path, keys, learned, unseen):
    sp, _ = train(tmp_path, "tok", [two_fields], "--json-keys", *keys)
    for word in learned:  # a word of every line it reads: one piece
        assert sp.encode(word, out_type=str) == ["\u2581" + word], word
    for word in unseen:  # never read: not a piece; its letters not in the other field are bytes
        assert not is_piece(sp, "\u2581" + word)
        assert any(p.startswith("<0x") for p in sp.encode(word, out_type=str)), word


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_model_type_is_the_trained_algorithm(two_fields, tmp_path, model_type):
    from sentencepiece import sentencepiece_model_pb2

    sp, proto = train(tmp_path, "tok", [two_fields], "--json-keys", "a", "b",
                      "--model-type", model_type)
    spec = sentencepiece_model_pb2.TrainerSpec
    assert proto.trainer_spec.model_type == {"bpe": spec.BPE, "unigram": spec.UNIGRAM}[model_type]
    # the learned pieces (after the 3 specials and 256 bytes): BPE scores a merge by its
    # rank (0, -1, -2, ...), unigram by the piece's log-probability
    scores = [sp.get_score(i) for i in range(259, sp.get_piece_size())]
    ranks = [-float(i) for i in range(len(scores))]
    if model_type == "bpe":
        assert scores == ranks
    else:
        assert all(s < 0 for s in scores) and sum(s != int(s) for s in scores) > len(scores) // 2


@pytest.fixture(scope="module")
def marked_lines(tmp_path_factory):
    """A text file of 250 lines; line i holds a character no other line has (3 times)."""
    rng = random.Random(1)
    words = pseudo_words(80, seed=1)
    marks = [chr(0x4E00 + i) for i in range(250)]  # CJK ideographs, one per line
    path = tmp_path_factory.mktemp("marked") / "marked.txt"
    path.write_text("".join(" ".join([m * 3] + rng.choices(words, k=5)) + "\n" for m in marks),
                    encoding="utf-8")
    return str(path), marks


def test_max_sentences_bounds_the_lines_trained_on(marked_lines, tmp_path):
    """Every character of a line read becomes a piece (character coverage 0.9999 of a few
    thousand characters keeps even a character seen 3 times), so the marks that are
    pieces count the lines the trainer read."""
    path, marks = marked_lines
    common = ["--input-format", "text"]
    sampled, _ = train(tmp_path, "sampled", [path], *common, "--max-sentences", 101,
                       vocab_size=560)
    everything, _ = train(tmp_path, "all", [path], *common, vocab_size=560)
    assert sum(is_piece(sampled, m) for m in marks) == 101
    assert sum(is_piece(everything, m) for m in marks) == len(marks)


def marks_learned(sp, marks):
    return {m for m in marks if is_piece(sp, m)}


def test_seed_fixes_the_sample_across_processes(marked_lines, tmp_path):
    """250 lines, --max-sentences 101: the same --seed writes the same model file in two
    fresh processes; another seed trains on another 101 lines (the marks that are pieces)."""
    import sentencepiece

    path, marks = marked_lines
    flags = ["--input", path, "--input-format", "text", "--vocab-size", "560",
             "--max-sentences", "101"]
    written = []
    for name in ("first", "second"):
        prefix = str(tmp_path / name)
        proc = subprocess.run([sys.executable, os.path.join(TOOLS, "train_tokenizer.py"), *flags,
                               "--model-prefix", prefix, "--seed", "7"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout == (f"wrote {prefix}.model (vocab 560; trained on 101 of 250 lines, "
                               "sampled with --seed 7)\n")
        with open(prefix + ".model", "rb") as f:
            written.append(f.read())
    assert written[0] == written[1]
    seven = marks_learned(sentencepiece.SentencePieceProcessor(model_proto=written[0]), marks)
    eight, _ = train(tmp_path, "eight", [path], "--input-format", "text", "--max-sentences", 101,
                     "--seed", 8, vocab_size=560)
    eight = marks_learned(eight, marks)
    assert len(seven) == len(eight) == 101 and seven != eight


def test_every_line_is_used_whatever_the_seed(marked_lines, tmp_path):
    """No more lines than --max-sentences: nothing to sample, the seed changes nothing."""
    path, marks = marked_lines
    models = []
    for seed in (1, 2):
        sp, proto = train(tmp_path, f"seed{seed}", [path], "--input-format", "text",
                          "--max-sentences", 250, "--seed", seed, vocab_size=560)
        assert marks_learned(sp, marks) == set(marks)
        models.append(proto.SerializeToString())
    assert models[0] == models[1]


def test_sample_is_uniform_and_in_input_order():
    """sample_lines draws each of n lines with probability k/n: over 4000 seeds every line's
    count is within 5 binomial standard deviations of 4000 k/n; each sample keeps the
    input order, and 3 lines of a size-5 sample are all 3. A line over sentencepiece's
    16384 bytes (which it would skip) is left out and counted."""
    from megatron_jreg.data.tokenizers.training import sample_lines

    n, k, seeds = 12, 4, 4000
    lines = [f"line {i:02d}" for i in range(n)]
    counts = dict.fromkeys(lines, 0)
    for seed in range(seeds):
        sample = sample_lines(iter(lines), k, seed)
        assert sample.total == n and len(sample.lines) == k and sample.sampled
        assert sample.lines == sorted(sample.lines)
        for line in sample.lines:
            counts[line] += 1
    mean, sd = seeds * k / n, (seeds * k / n * (1 - k / n)) ** 0.5
    assert all(abs(c - mean) < 5 * sd for c in counts.values()), counts
    small = sample_lines(iter(lines[:3]), 5, 0)
    assert small.lines == lines[:3] and small.total == 3 and not small.sampled
    longest, over = "\u00e9" * 8192, "\u00e9" * 8192 + "a"  # 16384 and 16385 UTF-8 bytes
    edge = sample_lines(iter(["a", longest, over, "b"]), 5, 0)
    assert (edge.lines, edge.total, edge.too_long) == (["a", longest, "b"], 3, 1)


def test_input_format_text_reads_the_raw_lines(two_fields, tmp_path):
    """The same JSONL file: as jsonl only the fields' text is read, as text the whole lines,
    whose JSON punctuation is frequent enough to be merged into pieces."""
    as_jsonl, _ = train(tmp_path, "jsonl", [two_fields], "--json-keys", "a", "b")
    as_text, _ = train(tmp_path, "text", [two_fields], "--input-format", "text")
    for piece in ["{", "}", '"', ":", '{"', '":', '"}']:
        assert is_piece(as_text, piece) and not is_piece(as_jsonl, piece), piece


# ---- make_demo_corpus.py -------------------------------------------------------------------


def read_corpus(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_min_chars_drops_exactly_the_shorter_documents(tmp_path):
    make = tool_main("make_demo_corpus.py")
    every = tmp_path / "every.jsonl"
    assert make(["--output", str(every), "--min-chars", "1", "--max-docs", "150"]) == 0
    source = read_corpus(every)
    lengths = sorted(len(d["text"]) for d in source)
    assert lengths[0] < 200  # --min-chars 1 keeps docstrings the default (200) drops
    limit = lengths[len(lengths) // 2]  # a length some document has exactly
    expected = [d for d in source if len(d["text"]) >= limit]
    assert 0 < len(expected) < len(source)
    kept = tmp_path / "kept.jsonl"
    assert make(["--output", str(kept), "--min-chars", str(limit),
                 "--max-docs", str(len(expected))]) == 0
    # the same documents in the same order, less those under the limit; one of exactly
    # --min-chars characters is kept
    assert read_corpus(kept) == expected
    assert min(len(d["text"]) for d in expected) == limit
