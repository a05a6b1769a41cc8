"""Input formats beyond plain JSONL: zstd-compressed JSONL, Parquet, and --split-sentences
with nltk punkt parameters written by the test (no download)."""

import json
import os
import subprocess
import sys

import pytest
from preprocess_helpers import make_documents, write_jsonl
from test_preprocess_roundtrip import read_documents

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.tokenizers.build import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BYTE = ["--tokenizer-type", "ByteTokenizer", "--append-eod"]


def test_zstd_jsonl_and_parquet(tmp_path, capsys):
    zstandard = pytest.importorskip("zstandard")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = make_documents(120, seed=5)
    tok = build_tokenizer("ByteTokenizer")
    expected = [tok.encode(t) + [tok.eod] for t in docs]

    zst = tmp_path / "d.jsonl.zst"
    payload = "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(docs))
    zst.write_bytes(zstandard.ZstdCompressor().compress(payload.encode("utf-8")))
    parquet = tmp_path / "d.parquet"
    # several row groups, so the reader's batches cross them
    pq.write_table(pa.table({"n": list(range(len(docs))), "text": docs}), parquet,
                   row_group_size=17)

    for path, name in ((zst, "zst"), (parquet, "parquet")):
        prefix = str(tmp_path / name)
        assert main(["--input", str(path), "--output-prefix", prefix, *BYTE, "--workers", "2",
                     "--chunk-bytes", "4096"]) == 0
        got, _ = read_documents(prefix + "_text_document")
        assert got == expected, name

    # a Parquet column that is not there, and a null value: exit 2 naming the fix / the row
    assert main(["--input", str(parquet), "--output-prefix", str(tmp_path / "bad"), *BYTE,
                 "--json-keys", "body"]) == 2
    assert "Parquet columns ['body'] not found" in capsys.readouterr().err
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["fine text", None, "more text"]}), nulls)
    assert main(["--input", str(nulls), "--output-prefix", str(tmp_path / "n"), *BYTE]) == 2
    err = capsys.readouterr().err
    assert f"{nulls}:2:" in err and "NoneType" in err
    assert not list(tmp_path.glob("n_text_document.*"))
    assert main(["--input", str(nulls), "--output-prefix", str(tmp_path / "n"), *BYTE,
                 "--skip-invalid"]) == 0
    got, _ = read_documents(str(tmp_path / "n_text_document"))
    assert got == [tok.encode(t) + [tok.eod] for t in ("fine text", "more text")]


@pytest.fixture
def punkt_data(tmp_path):
    """nltk's punkt_tab layout with one abbreviation ("dr"), the rest empty."""
    pytest.importorskip("nltk")
    import nltk

    if not hasattr(nltk.tokenize, "PunktTokenizer"):
        pytest.skip("nltk < 3.9 reads pickled punkt data; this writes punkt_tab")
    lang = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True)
    (lang / "abbrev_types.txt").write_text("dr\n")
    for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (lang / name).write_text("")
    return str(tmp_path / "nltk_data")


def run_tool(argv, nltk_data=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("NLTK_DATA", None)
    if nltk_data:
        env["NLTK_DATA"] = nltk_data
    return subprocess.run([sys.executable, "tools/preprocess_data.py", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("keep_newlines", [False, True])
def test_split_sentences(tmp_path, punkt_data, keep_newlines):
    docs = ["One sentence here. And a second one.\nThird line? Yes, Dr. Smith agrees.",
            "Just one."]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    prefix = str(tmp_path / "s")
    proc = run_tool(["--input", data, "--output-prefix", prefix, *BYTE, "--split-sentences",
                     "--workers", "2"] + (["--keep-newlines"] if keep_newlines else []),
                    nltk_data=punkt_data)
    assert proc.returncode == 0, proc.stderr
    if keep_newlines:  # Megatron-LM's rule: the whitespace after a sentence stays with it
        sentences = [["One sentence here. ", "And a second one.\n", "Third line? ",
                      "Yes, Dr. Smith agrees."], ["Just one."]]
    else:  # "Dr." is a listed abbreviation, so no break after it
        sentences = [["One sentence here.", "And a second one.", "Third line?",
                      "Yes, Dr. Smith agrees."], ["Just one."]]
    tok = build_tokenizer("ByteTokenizer")
    expected = []
    for doc in sentences:
        ids = [tok.encode(s) for s in doc]
        ids[-1].append(tok.eod)  # EOD joins each document's last sentence
        expected += ids
    got, ds = read_documents(prefix + "_text_sentence")
    assert got == expected
    assert ds.document_indices.tolist() == [0, 4, 5]


def test_split_sentences_without_punkt_data_says_how_to_get_it(tmp_path):
    nltk = pytest.importorskip("nltk")
    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        pytest.skip("this machine has punkt data installed")
    except LookupError:
        pass
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "One. Two."}])
    proc = run_tool(["--input", data, "--output-prefix", str(tmp_path / "s"), *BYTE,
                     "--split-sentences"], nltk_data=str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert "nltk.download('punkt" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
