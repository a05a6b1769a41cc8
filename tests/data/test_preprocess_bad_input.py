"""Bad input and faults: the message, the exit code, and never a partial .bin/.idx pair."""

import os
import signal

import pytest
from preprocess_helpers import make_documents, output_files, write_jsonl

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.preprocess import pipeline as preprocess

GOOD = '{"text": "a good document"}'
BAD_LINES = [
    ('{"text": "unterminated', "malformed JSON"),
    ('{"body": "no text key"}', "missing key 'text' (keys present: body)"),
    ('{"text": 42}', "value of 'text' is int, expected a string"),
    ('{"text": null}', "value of 'text' is NoneType, expected a string"),
    ('{"text": "   "}', "empty document in 'text'"),
    ('["a", "list"]', "expected a JSON object, got list"),
    (b'{"text": "bad \xff byte"}', "invalid UTF-8 (byte 0xff"),
]


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return str(path)


def argv(data, prefix, *extra):
    return ["--input", data, "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer",
            "--append-eod", *extra]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("bad, message", BAD_LINES)
def test_bad_line_stops_with_file_and_line(tmp_path, capsys, bad, message, workers):
    # The bad line sits in a later chunk, so the line number must survive chunking.
    data = write_lines(tmp_path / "d.jsonl", [GOOD] * 30 + [bad] + [GOOD] * 5)
    rc = main(argv(data, str(tmp_path / "out"), "--workers", str(workers), "--chunk-bytes", "64"))
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{data}:31: " in err and message in err and "--skip-invalid" in err
    assert output_files(tmp_path) == []


def test_skip_invalid_counts_and_keeps_good_lines(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lines = [GOOD]
    for bad, _ in BAD_LINES:
        lines += [bad, GOOD]
    data = write_lines(tmp_path / "d.jsonl", lines + ["", GOOD])  # blank lines are not documents
    prefix = str(tmp_path / "out")
    assert main(argv(data, prefix, "--skip-invalid", "--chunk-bytes", "64")) == 0
    out = capsys.readouterr().out
    assert "skipped 7" in out
    assert "skipped 1 x malformed JSON (first at" in out and f"{data}:2)" in out
    assert "skipped 1 x empty document" in out and "skipped 1 x invalid UTF-8" in out
    assert "skipped 2 x non-string value" in out
    assert len(IndexedDataset(prefix + "_text_document")) == len(BAD_LINES) + 2


def test_text_format_blank_line_is_an_empty_document(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("first\n\nthird\n")
    assert main(argv(str(data), str(tmp_path / "o"), "--input-format", "text")) == 2
    assert f"{data}:2: empty document" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing input", "no such file or directory"),
        ("empty glob", "matches no files"),
        ("tokenizer file", "not a file"),
        ("bad tokenizer", "cannot load"),
        ("output dir", "cannot create directory"),
        ("output exists", "already exists; pass --overwrite"),
        ("bad flag value", "--workers must be at least 1"),
    ],
)
def test_usage_errors_exit_2(tmp_path, capsys, case, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(5)])
    prefix = str(tmp_path / "out")
    args = argv(data, prefix)
    if case == "missing input":
        args[1] = str(tmp_path / "nope.jsonl")
    elif case == "empty glob":
        args[1] = str(tmp_path / "*.nothing")
    elif case == "tokenizer file":
        args = argv(data, prefix)[:4] + ["--tokenizer-type", "SentencePieceTokenizer",
                                         "--tokenizer-model", str(tmp_path / "no.model")]
    elif case == "bad tokenizer":
        bad = tmp_path / "bad.model"
        bad.write_bytes(b"garbage")
        args = argv(data, prefix)[:4] + ["--tokenizer-type", "SentencePieceTokenizer",
                                         "--tokenizer-model", str(bad)]
    elif case == "output dir":
        args[3] = str(tmp_path / "d.jsonl" / "out")  # a file where a directory must go
    elif case == "output exists":
        assert main(args) == 0
        capsys.readouterr()
    elif case == "bad flag value":
        args += ["--workers", "0"]
    before = output_files(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert output_files(tmp_path) == before
    if case == "output exists":
        assert main(args + ["--overwrite"]) == 0


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--input", "x"])
    assert e.value.code == 2


@pytest.mark.parametrize("how, code", [("ctrl-c", 130), ("sigterm", 143)])
@pytest.mark.parametrize("partitions", [1, 2])
def test_interrupted_run_leaves_no_dataset(tmp_path, monkeypatch, capsys, how, code, partitions):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(300)])
    calls = {"n": 0}
    real_update = preprocess.Progress.update

    def interrupt_midway(self, stats, new_docs):
        real_update(self, stats, new_docs)
        calls["n"] += 1
        if calls["n"] == 3 or partitions > 1:  # partitions: a partition's child is interrupted
            if how == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler raises in the parent

    monkeypatch.setattr(preprocess.Progress, "update", interrupt_midway)
    prefix = str(tmp_path / "out")
    args = argv(data, prefix, "--workers", "2", "--chunk-bytes", "256",
                "--partitions", str(partitions))
    assert main(args) == code
    assert "partial outputs removed" in capsys.readouterr().err
    assert output_files(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is not preprocess._raise_terminated


@pytest.mark.parametrize("how, code", [("ctrl-c", 130), ("sigterm", 143)])
def test_interrupted_merge_leaves_no_dataset(tmp_path, monkeypatch, capsys, how, code):
    """--partitions: every partition finished, then the parent is interrupted between the
    first and the second partition's add_index (the merge into the final dataset)."""
    from megatron_jreg.data.preprocess.writer import IndexedDatasetWriter

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(300)])
    real_add = IndexedDatasetWriter.add_index
    merged = []

    def interrupt_after_first(self, prefix):
        real_add(self, prefix)
        merged.append(prefix)
        assert os.getpid() == parent  # the merge runs in the parent, not in a partition
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)

    parent = os.getpid()
    monkeypatch.setattr(IndexedDatasetWriter, "add_index", interrupt_after_first)
    prefix = str(tmp_path / "out")
    args = argv(data, prefix, "--workers", "2", "--chunk-bytes", "256", "--partitions", "2")
    assert main(args) == code
    assert len(merged) == 1, merged  # interrupted inside the merge, after one partition
    assert "partial outputs removed" in capsys.readouterr().err
    assert output_files(tmp_path) == []  # no final dataset, no partition directory
    assert signal.getsignal(signal.SIGTERM) is not preprocess._raise_terminated
