"""Inputs that used to crash or pass silently: unencodable text, damaged compressed files,
empty inputs and inputs given twice. Each must be one ``error:`` line naming the file, exit 2,
and leave no output behind."""

import gzip
import os
import subprocess
import sys

import pytest
from preprocess_helpers import make_documents, output_files, write_jsonl

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.tokenizers.build import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = '{"text": "a good document"}'
# A JSON escape of a lone surrogate: valid JSON, but no UTF-8 text (nothing can encode it).
SURROGATE = '{"text": "bad \\udcff here"}'


def argv(inputs, prefix, *extra):
    inputs = [inputs] if isinstance(inputs, str) else inputs
    return ["--input", *inputs, "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer",
            "--append-eod", *extra]


def one_error_line(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


# -- 8: text the tokenizer cannot encode -----------------------------------------------------
@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("workers", [1, 2])
def test_lone_surrogate_is_a_bad_line(tmp_path, capsys, workers, partitions):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 30 + [SURROGATE] + [GOOD] * 5)
    rc = main(argv(data, str(tmp_path / "out"), "--workers", str(workers), "--chunk-bytes", "64",
                   "--partitions", str(partitions)))
    err = one_error_line(capsys)
    assert rc == 2
    assert f"{data}:31: " in err and "lone surrogate" in err and "--skip-invalid" in err, err
    assert output_files(tmp_path) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_lone_surrogate_is_skipped_and_counted(tmp_path, capsys, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, SURROGATE, GOOD, SURROGATE, GOOD])
    prefix = str(tmp_path / "out")
    assert main(argv(data, prefix, "--skip-invalid", "--workers", str(workers))) == 0
    out = capsys.readouterr().out
    assert "skipped 2" in out and f"(first at {data}:2)" in out, out
    assert len(IndexedDataset(prefix + "_text_document")) == 3


_ENCODE_PACKED = ByteTokenizer.encode_packed


def _refuse_boom(self, texts, *args, **kwargs):
    """``ByteTokenizer.encode_packed``, the call preprocessing makes, refusing "BOOM"."""
    if any("BOOM" in t for t in texts):
        raise ValueError("this tokenizer cannot take BOOM")
    return _ENCODE_PACKED(self, texts, *args, **kwargs)


@pytest.mark.parametrize("skip", [False, True])
def test_text_the_tokenizer_rejects_is_a_bad_line(tmp_path, capsys, monkeypatch, skip):
    # Any exception from the tokenizer on one document: the line, not a worker traceback.
    # Workers are forked, so they see the patched tokenizer.
    monkeypatch.setattr(ByteTokenizer, "encode_packed", _refuse_boom)
    lines = [GOOD] * 12 + ['{"text": "BOOM goes the line"}'] + [GOOD] * 3
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    prefix = str(tmp_path / "out")
    rc = main(argv(data, prefix, "--workers", "2", "--chunk-bytes", "64",
                   *(["--skip-invalid"] if skip else [])))
    if skip:
        assert rc == 0
        out = capsys.readouterr().out
        assert "skipped 1" in out and f"(first at {data}:13)" in out, out
    else:
        err = one_error_line(capsys)
        assert rc == 2
        assert f"{data}:13: " in err and "cannot take BOOM" in err, err
        assert output_files(tmp_path) == []


def test_several_rejected_lines_in_one_chunk_are_all_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ByteTokenizer, "encode_packed", _refuse_boom)
    boom = '{"text": "BOOM"}'
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, boom, GOOD, boom, boom, GOOD])
    assert main(argv(data, str(tmp_path / "out"), "--skip-invalid")) == 0
    out = capsys.readouterr().out
    assert "done: 3 documents" in out and "skipped 3" in out and f"(first at {data}:2)" in out, out


def test_earliest_bad_line_wins_over_a_later_parse_error(tmp_path, capsys, monkeypatch):
    # An unencodable line before a malformed one in the same chunk is the one reported.
    monkeypatch.setattr(ByteTokenizer, "encode_packed", _refuse_boom)
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"text": "BOOM"}', '{"text": "unterminated'])
    assert main(argv(data, str(tmp_path / "out"))) == 2
    assert f"{data}:2: " in one_error_line(capsys)


# -- 11: truncated or corrupt compressed input --------------------------------------------
def _compressed(kind, payload):
    if kind == "gz":
        return gzip.compress(payload)
    import zstandard

    return zstandard.ZstdCompressor().compress(payload)


@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_compressed_input_is_one_line(tmp_path, capsys, kind, damage):
    if kind == "zst":
        pytest.importorskip("zstandard")
    docs = [{"text": t} for t in make_documents(2000, seed=3)]
    plain = write_jsonl(tmp_path / "plain.txt", docs)  # .txt: not an input, kept out of listings
    raw = open(plain, "rb").read()
    os.unlink(plain)
    blob = _compressed(kind, raw)
    blob = blob[: len(blob) * 2 // 3] if damage == "truncated" else b"definitely not compressed\n"
    data = tmp_path / f"d.jsonl.{kind}"
    data.write_bytes(blob)
    rc = main(argv(str(data), str(tmp_path / "out"), "--chunk-bytes", "4096"))
    err = one_error_line(capsys)
    assert rc == 2
    assert f"{data}:" in err and ("truncated" in err or "corrupt" in err), err
    if damage == "truncated":  # the line where the data stops is named
        line = int(err.split(f"{data}:")[1].split(":")[0])
        assert 1 < line <= len(docs), err
    assert [f for f in output_files(tmp_path) if f != data.name] == []


# -- 12: empty inputs and inputs given twice ----------------------------------------------
@pytest.mark.parametrize("content", ["", "\n\n  \n", "gz-empty"])
@pytest.mark.parametrize("partitions", [1, 2])
def test_empty_input_is_refused_unless_allowed(tmp_path, capsys, content, partitions):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    names = ["a.jsonl", "b.jsonl"]
    if content == "gz-empty":
        names = ["a.jsonl.gz", "b.jsonl.gz"]
    paths = []
    for name in names:
        p = tmp_path / name
        p.write_bytes(gzip.compress(b"") if content == "gz-empty" else content.encode())
        paths.append(str(p))
    prefix = str(tmp_path / "out")
    args = argv(paths, prefix, "--partitions", str(partitions))
    assert main(args) == 2
    err = one_error_line(capsys)
    assert all(p in err for p in paths) and "--allow-empty" in err, err
    assert output_files(tmp_path) == []
    assert main(args + ["--allow-empty"]) == 0
    assert IndexedDataset.exists(prefix + "_text_document")
    assert os.path.getsize(prefix + "_text_document.bin") == 0


@pytest.mark.parametrize("partitions", [1, 2])
def test_dev_null_is_an_empty_input(tmp_path, capsys, partitions):
    """/dev/null reads as an empty file and is taken as one (it was "no such file or
    directory"): refused with an empty file's line, written empty with --allow-empty."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    prefix = str(tmp_path / "out")
    assert main(argv(str(empty), prefix, "--partitions", str(partitions))) == 2
    as_a_file = one_error_line(capsys)
    assert main(argv(os.devnull, prefix, "--partitions", str(partitions))) == 2
    assert one_error_line(capsys) == as_a_file.replace(str(empty), os.devnull)
    assert output_files(tmp_path) == []
    assert main(argv(os.devnull, prefix, "--partitions", str(partitions), "--allow-empty")) == 0
    assert os.path.getsize(prefix + "_text_document.bin") == 0


def test_a_pipe_as_input_is_refused_as_not_a_file(tmp_path, capsys):
    """Inputs are read in byte ranges, which a pipe has not: said so (it was "no such file
    or directory")."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    assert main(argv(fifo, str(tmp_path / "out"))) == 2
    err = one_error_line(capsys)
    assert err == f"error: --input {fifo!r}: not a regular file; save it to a file first", err
    assert output_files(tmp_path) == ["fifo"]


def test_all_lines_skipped_is_empty_too(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", ['{"text": 1}', '{"body": "x"}'])
    assert main(argv(data, str(tmp_path / "out"), "--skip-invalid")) == 2
    err = one_error_line(capsys)
    assert data in err and "--allow-empty" in err and "skipped 2" in err, err
    assert output_files(tmp_path) == []


@pytest.mark.parametrize("how", ["same path", "relative and absolute", "via directory", "via glob"])
def test_input_given_twice_is_refused(tmp_path, capsys, monkeypatch, how):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(5)])
    monkeypatch.chdir(tmp_path)
    second = {"same path": data, "relative and absolute": "d.jsonl", "via directory": str(tmp_path),
              "via glob": str(tmp_path / "*.jsonl")}[how]
    assert main(argv([data, second], str(tmp_path / "out"))) == 2
    err = one_error_line(capsys)
    assert "twice" in err and "d.jsonl" in err, err
    assert output_files(tmp_path) == []


def test_help_lists_allow_empty():
    proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--allow-empty" in proc.stdout
