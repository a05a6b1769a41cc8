"""Megatron-LM's tokenizer types (Llama2Tokenizer, GPT2BPETokenizer, NullTokenizer) in the
tools around the trainer: ``preprocess_data.py`` writes the trainer's ids, a run's saved
config rebuilds its tokenizer (``build_run_tokenizer``), and ``export_tokenizer`` writes an
HF tokenizer that gives the run's ids."""

import json
import os
import subprocess
import sys

import numpy
import pytest
from preprocess_helpers import SENTENCES, make_documents, write_jsonl

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.tokenizers.megatron_lm import build_megatron_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NULL_VOCAB = 500
# no run of several leading spaces: the HF conversion of a sentencepiece model differs there
# (docs/evaluation.md)
TEXTS = ["Hello world: héllo 123.\nThe end.",
         "the quick brown fox jumps over the lazy dog",
         "numbers 12345 and 3.14; unicode: naïve café, 東京 🙂", "'s 't 're contractions don't"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A small GPT-2 style vocab.json/merges.txt (byte-level BPE), trained offline."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("gpt2")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join((SENTENCES + TEXTS) * 20), encoding="utf-8")
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=500, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    return str(root / "vocab.json"), str(root / "merges.txt")


def flags_and_tokenizer(kind, sp_model, gpt2_files):
    """(preprocess_data flags, build_megatron_tokenizer kwargs) of one type."""
    vocab, merges = gpt2_files
    return {
        "Llama2Tokenizer": (["--tokenizer-model", sp_model], {"tokenizer_model": sp_model}),
        "SentencePieceTokenizer": (["--tokenizer-model", sp_model], {"tokenizer_model": sp_model}),
        "GPT2BPETokenizer": (["--vocab-file", vocab, "--merge-file", merges],
                             {"vocab_file": vocab, "merge_file": merges}),
        "NullTokenizer": (["--vocab-size", str(NULL_VOCAB)], {"vocab_size": NULL_VOCAB}),
    }[kind]


def documents(kind, n=60):
    if kind == "NullTokenizer":  # text that is already ids, as Megatron-LM's NullTokenizer reads
        rng = numpy.random.default_rng(3)
        return [" ".join(map(str, rng.integers(0, NULL_VOCAB, rng.integers(1, 40))))
                for _ in range(n)]
    return make_documents(n, seed=11)


def read_documents(prefix):
    """Every sequence of a dataset, as megatron-core's reader (the trainer's) sees it."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.index.dtype


def expected_ids(kind, text, files):
    """The ids by another route than ours: sentencepiece itself (Megatron-LM's default
    Llama2Tokenizer; its legacy one puts BOS first), transformers' GPT-2 tokenizer on the same
    two files (GPT-2's byte-level BPE), the numbers themselves."""
    sp_model, (vocab, merges) = files
    if kind == "Llama2Tokenizer":
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
        return sp.encode(text)
    if kind == "GPT2BPETokenizer":
        from transformers import GPT2TokenizerFast

        assert os.path.dirname(vocab) == os.path.dirname(merges)
        return GPT2TokenizerFast.from_pretrained(os.path.dirname(vocab))(text)["input_ids"]
    return [int(x) for x in text.split(" ")]


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPT2BPETokenizer", "NullTokenizer"])
def test_preprocess_data_writes_the_trainers_ids(tmp_path, kind, sp_model, gpt2_files):
    flags, kwargs = flags_and_tokenizer(kind, sp_model, gpt2_files)
    docs = documents(kind)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    prefix = str(tmp_path / "out")
    assert main(["--input", data, "--output-prefix", prefix, "--tokenizer-type", kind, *flags,
                 "--append-eod", "--workers", "2", "--chunk-bytes", "600"]) == 0
    got, dtype = read_documents(prefix + "_text_document")
    tok = build_megatron_tokenizer(kind, **kwargs)  # what the trainer builds from these flags
    assert got == [tok.encode(t) + [tok.eod] for t in docs]
    assert got == [expected_ids(kind, t, (sp_model, gpt2_files)) + [tok.eod] for t in docs]
    eod = {"Llama2Tokenizer": 2, "NullTokenizer": NULL_VOCAB,  # the model's EOS; --vocab-size
           "GPT2BPETokenizer": json.load(open(gpt2_files[0]))["<|endoftext|>"]}[kind]
    assert tok.eod == eod and dtype == numpy.uint16


def test_gpt2_endoftext_in_a_text_stays_text(tmp_path, gpt2_files):
    """Without --append-eod no EOD is written (GPT-2's <|endoftext|> in a text stays text)."""
    vocab, merges = gpt2_files
    docs = ["a<|endoftext|>b " + t for t in TEXTS]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    prefix = str(tmp_path / "out")
    assert main(["--input", data, "--output-prefix", prefix, "--tokenizer-type",
                 "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]) == 0
    got, _ = read_documents(prefix + "_text_document")
    tok = build_megatron_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert got == [tok.encode(t) for t in docs]
    assert all(tok.eod not in ids for ids in got)


@pytest.mark.parametrize("case,flag", [
    ("no merge file", "--merge-file"),
    ("merge file missing", "--merge-file"),
    ("vocab file missing", "--vocab-file"),
    ("no model", "--tokenizer-model"),
    ("no vocab size", "--vocab-size"),
    ("vocab file for another type", "--vocab-file"),
])
def test_missing_or_wrong_file_is_one_line_naming_the_flag(tmp_path, capsys, gpt2_files, case,
                                                           flag):
    vocab, merges = gpt2_files
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "1 2 3"}])
    tokenizer = {
        "no merge file": ["GPT2BPETokenizer", "--vocab-file", vocab],
        "merge file missing": ["GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
                               str(tmp_path / "merges.txt")],
        "vocab file missing": ["GPT2BPETokenizer", "--vocab-file", str(tmp_path / "v.json"),
                               "--merge-file", merges],
        "no model": ["Llama2Tokenizer"],
        "no vocab size": ["NullTokenizer"],
        "vocab file for another type": ["NullTokenizer", "--vocab-size", "9", "--vocab-file",
                                        vocab],
    }[case]
    prefix = str(tmp_path / "out")
    assert main(["--input", data, "--output-prefix", prefix, "--tokenizer-type",
                 *tokenizer]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert not os.path.exists(prefix + "_text_document.bin")


def test_cli_missing_merge_file_exits_2_with_one_line(tmp_path, gpt2_files):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", data,
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", gpt2_files[0]],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: GPT2BPETokenizer needs --merge-file (GPT-2's merges.txt)"]


def test_sft_refuses_megatron_lm_types(tmp_path, capsys):
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "1"}]}])
    assert main(["--sft", "--input", data, "--output-prefix", str(tmp_path / "out"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "9"]) == 2
    assert "--sft does not support --tokenizer-type NullTokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPT2BPETokenizer"])
def test_the_tool_imports_neither_torch_nor_megatron(tmp_path, kind, sp_model, gpt2_files):
    from test_indexed_writer import _NO_HEAVY_IMPORTS  # workers and parent checked

    flags, _ = flags_and_tokenizer(kind, sp_model, gpt2_files)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(30)])
    proc = subprocess.run(
        [sys.executable, "-c", _NO_HEAVY_IMPORTS, os.path.join(REPO, "tools", "preprocess_data.py"),
         "--input", data, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", kind,
         *flags, "--append-eod", "--workers", "2", "--chunk-bytes", "500"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout


# -- reading a run back -----------------------------------------------------------------------


def run_configs(kind, sp_model, gpt2_files, legacy=False):
    """(configs as a checkpoint's run_config.yaml gives them back, the trainer's tokenizer).

    The trainer's own ``run_tokenizer`` runs on the flags (it sets NullTokenizer's
    vocabulary to --vocab-size + 1), then the sections go through YAML as a save does."""
    from megatron_jreg.config.model import ModelConfig
    from megatron_jreg.config.run import DataConfig
    from megatron_jreg.config.yaml_settings import from_yaml_text, to_yaml
    from megatron_jreg.training.source import run_tokenizer

    _, kwargs = flags_and_tokenizer(kind, sp_model, gpt2_files)
    data = DataConfig(data_path=["x_text_document"], tokenizer_type=kind,
                      tokenizer_model=kwargs.get("tokenizer_model"),
                      vocab_file=kwargs.get("vocab_file"), merge_file=kwargs.get("merge_file"),
                      legacy_tokenizer=legacy)
    model = ModelConfig(vocab_size=kwargs.get("vocab_size"))
    trainers, model = run_tokenizer(data, model)
    sections = {"data": DataConfig, "model": ModelConfig}
    return from_yaml_text(to_yaml({"data": data, "model": model}), sections), trainers


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPT2BPETokenizer", "NullTokenizer"])
def test_build_run_tokenizer_gives_the_trainers_ids(kind, sp_model, gpt2_files):
    from megatron_jreg.checkpoint.run_configs import build_run_tokenizer

    configs, trainers = run_configs(kind, sp_model, gpt2_files)
    ours = build_run_tokenizer(configs)
    texts = documents(kind, 8) + ([] if kind == "NullTokenizer" else TEXTS)
    assert [ours.encode(t) for t in texts] == [trainers.encode(t) for t in texts] == [
        expected_ids(kind, t, (sp_model, gpt2_files)) for t in texts]
    assert (ours.vocab_size, ours.eod) == (trainers.vocab_size, trainers.eod)
    assert ours.unique_identifiers == trainers.unique_identifiers
    if kind == "NullTokenizer":
        assert (ours.vocab_size, ours.eod) == (NULL_VOCAB + 1, NULL_VOCAB)


def test_build_run_tokenizer_finds_moved_gpt2_files(tmp_path, sp_model, gpt2_files):
    import shutil

    from megatron_jreg.checkpoint.run_configs import build_run_tokenizer
    from megatron_jreg.errors import InputError

    configs, trainers = run_configs("GPT2BPETokenizer", sp_model, gpt2_files)
    configs["data"].vocab_file = str(tmp_path / "gone" / "vocab.json")
    with pytest.raises(InputError, match="--vocab-file .* is not a file.*--tokenizer-model"):
        build_run_tokenizer(configs)
    moved = tmp_path / "moved"
    moved.mkdir()
    for path in gpt2_files:
        shutil.copy(path, moved)
    ours = build_run_tokenizer(configs, str(moved))
    assert [ours.encode(t) for t in TEXTS] == [trainers.encode(t) for t in TEXTS]
    with pytest.raises(InputError, match="directory holding its vocab.json and merges.txt"):
        build_run_tokenizer(configs, str(moved / "vocab.json"))


# -- HF export --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPT2BPETokenizer"])
def test_export_tokenizer_gives_the_runs_ids(tmp_path, kind, sp_model, gpt2_files):
    from transformers import AutoTokenizer

    from megatron_jreg.checkpoint.to_hf import export_tokenizer

    configs, trainers = run_configs(kind, sp_model, gpt2_files)
    out = tmp_path / "hf"
    out.mkdir()
    assert export_tokenizer(configs, str(out)) == []
    hf = AutoTokenizer.from_pretrained(str(out))
    texts = TEXTS + make_documents(5, seed=4)
    assert [hf(t)["input_ids"] for t in texts] == [trainers.encode(t) for t in texts]
    assert hf.eos_token_id == trainers.eod
    if kind == "Llama2Tokenizer":  # no BOS, as Megatron-LM's default Llama2Tokenizer
        assert hf("hello")["input_ids"][0] != trainers.bos == 1
    else:
        assert hf.decode(hf(TEXTS[2])["input_ids"]) == TEXTS[2]


def test_export_of_legacy_sentencepiece_is_refused(tmp_path, sp_model, gpt2_files):
    """--legacy-tokenizer SentencePieceTokenizer cuts texts at its special tokens and encodes
    each piece with sentencepiece's own leading space (" c" after <SEP> is two pieces), which
    no Hugging Face tokenizer here gives: refused in one line before anything is written,
    naming --no-tokenizer; without --legacy-tokenizer the export gives the run's ids."""
    from transformers import AutoTokenizer

    from megatron_jreg.checkpoint.to_hf import export_tokenizer
    from megatron_jreg.errors import InputError

    configs, trainers = run_configs("SentencePieceTokenizer", sp_model, gpt2_files, legacy=True)
    assert len(trainers.encode("a<SEP> c")) == len(trainers.encode("a")) + 3
    with pytest.raises(InputError) as err:
        export_tokenizer(configs, str(tmp_path))
    assert "--no-tokenizer" in str(err.value) and "<EOD>" in str(err.value)
    assert "\n" not in str(err.value) and os.listdir(tmp_path) == []
    configs, trainers = run_configs("SentencePieceTokenizer", sp_model, gpt2_files)
    assert export_tokenizer(configs, str(tmp_path)) == []
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert [hf(t)["input_ids"] for t in TEXTS] == [trainers.encode(t) for t in TEXTS]
    assert hf.eos_token_id == trainers.eod


@pytest.mark.parametrize("legacy", [False, True])
def test_export_of_hugging_face_tokenizer_gives_the_runs_ids(tmp_path, legacy):
    """HuggingFaceTokenizer: by default the run's ids have none of the tokenizer's special
    tokens (Megatron-LM's default), and neither does the export's encoding; with
    --legacy-tokenizer both start with its BOS."""
    from megatron_lm_tokenizer_files import make_hf_llama3_style
    from transformers import AutoTokenizer

    from megatron_jreg.checkpoint.to_hf import export_tokenizer
    from megatron_jreg.config.model import ModelConfig
    from megatron_jreg.config.run import DataConfig
    from megatron_jreg.config.yaml_settings import from_yaml_text, to_yaml
    from megatron_jreg.training.source import run_tokenizer

    source = make_hf_llama3_style(str(tmp_path / "tok"))
    data = DataConfig(data_path=["x_text_document"], tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=source, legacy_tokenizer=legacy)
    trainers, model = run_tokenizer(data, ModelConfig())
    configs = from_yaml_text(to_yaml({"data": data, "model": model}),
                             {"data": DataConfig, "model": ModelConfig})
    out = tmp_path / "hf"
    out.mkdir()
    assert export_tokenizer(configs, str(out)) == []
    hf = AutoTokenizer.from_pretrained(str(out))
    texts = TEXTS + ["", "The quick brown fox"]
    ids = [trainers.encode(t) for t in texts]
    assert [hf(t)["input_ids"] for t in texts] == ids
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert [row[0] == bos for row in ids if row] == [legacy] * len([row for row in ids if row])
    assert all(bos not in row[1:] for row in ids)


def test_export_tokenizer_refuses_null_tokenizer(tmp_path, sp_model, gpt2_files):
    from megatron_jreg.checkpoint.to_hf import export_tokenizer
    from megatron_jreg.errors import InputError

    configs, _ = run_configs("NullTokenizer", sp_model, gpt2_files)
    with pytest.raises(InputError) as err:
        export_tokenizer(configs, str(tmp_path))
    assert "--no-tokenizer" in str(err.value) and "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []
