"""Bad inputs to eval_jump: one line on stderr naming the problem, exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_jreg.commands.eval_jump import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_error(capsys, argv):
    try:
        rc = main([str(a) for a in argv] + ["--no-progress"])
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    # the whole of stderr is one line: no usage block, warning or second line before or after
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith("eval_jump: error: "), repr(err)
    return err.rstrip("\n")


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("w1 w2 w3\n")
    return path


def test_missing_model_dir(capsys, tmp_path, text):
    err = run_error(capsys, ["--hf-model", tmp_path / "nope", "--text-file", text])
    assert "--hf-model" in err and "no such directory" in err


def test_not_a_hf_model_dir(capsys, tmp_path, text):
    err = run_error(capsys, ["--hf-model", tmp_path, "--text-file", text])
    assert "config.json" in err and "save_pretrained" in err


def test_broken_config(capsys, tmp_path, text, tiny_hf_model):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    for name in os.listdir(tiny_hf_model):
        if name.startswith("tokenizer"):
            (broken / name).write_bytes(open(os.path.join(tiny_hf_model, name), "rb").read())
    err = run_error(capsys, ["--hf-model", broken, "--text-file", text])
    assert "--hf-model" in err and "cannot load" in err


def test_missing_text_file(capsys, tmp_path, tiny_hf_model):
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--text-file", tmp_path / "missing.txt"])
    assert "--text-file" in err and "no such file" in err


def test_empty_text(capsys, tmp_path, tiny_hf_model):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--text-file", empty])
    assert "no tokens to evaluate" in err


def test_malformed_jsonl(capsys, tmp_path, tiny_hf_model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2"}\n\n{"text": oops}\n')
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--jsonl", bad])
    assert f"{bad}:3" in err and "malformed JSON" in err


def test_jsonl_missing_key(capsys, tmp_path, tiny_hf_model):
    bad = tmp_path / "key.jsonl"
    bad.write_text('{"body": "w1 w2"}\n')
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--jsonl", bad])
    assert f"{bad}:1" in err and "--json-key" in err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if eval_jump loads a model: input errors must come first."""
    from megatron_jreg.analysis import hf_source

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(hf_source, "load_hf_source", load)


BINARY = b"\x00\x01PK\x03\x04" + bytes(range(0x80, 0x100)) * 16  # not UTF-8, no newline


@pytest.mark.parametrize("flag", ["--text-file", "--jsonl"])
@pytest.mark.parametrize("late", [False, True], ids=["binary", "binary_after_20k_of_text"])
def test_binary_text_input(capsys, tmp_path, tiny_hf_model, no_model_load, flag, late):
    line = b"w1 w2 w3\n" if flag == "--text-file" else b'{"text": "w1 w2 w3"}\n'
    good = line * (20_000 // len(line)) if late else b""
    path = tmp_path / "input.bin"
    path.write_bytes(good + BINARY)
    err = run_error(capsys, ["--hf-model", tiny_hf_model, flag, path])
    lineno = good.count(b"\n") + 1
    assert f"{flag} {path}:{lineno}: not UTF-8 text" in err, err
    assert "UTF-8 encoded" in err


def test_bad_jsonl_line_fails_before_the_model_loads(capsys, tmp_path, tiny_hf_model,
                                                     no_model_load):
    bad = tmp_path / "late.jsonl"
    bad.write_text('{"text": "w1 w2"}\n' * 3000 + '{"text": oops}\n')
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--jsonl", bad])
    assert f"{bad}:3001" in err and "malformed JSON" in err


def test_missing_indexed_dataset(capsys, tmp_path, tiny_hf_model):
    err = run_error(
        capsys, ["--hf-model", tiny_hf_model, "--data-path", tmp_path / "corpus_text_document"]
    )
    assert "--data-path" in err and ".idx" in err


def test_no_model_and_no_reports(capsys, text):
    err = run_error(capsys, ["--text-file", text])
    assert "--hf-model" in err
    err = run_error(capsys, [])
    assert "nothing to measure" in err


def test_no_evaluation_text(capsys, tiny_hf_model):
    err = run_error(capsys, ["--hf-model", tiny_hf_model])
    assert "--text-file" in err


def test_two_inputs(capsys, tmp_path, text, tiny_hf_model):
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--text-file", text, "--jsonl", text])
    assert "choose one" in err


def test_bad_numbers(capsys, text, tiny_hf_model):
    assert "--seq-length" in run_error(
        capsys, ["--hf-model", tiny_hf_model, "--text-file", text, "--seq-length", 0]
    )
    assert "--batch-size" in run_error(
        capsys, ["--hf-model", tiny_hf_model, "--text-file", text, "--batch-size", 0]
    )
    assert "--max-tokens" in run_error(
        capsys, ["--hf-model", tiny_hf_model, "--text-file", text, "--max-tokens", 0]
    )


def test_label_count(capsys, text, tiny_hf_model):
    err = run_error(
        capsys, ["--hf-model", tiny_hf_model, "--text-file", text, "--label", "a", "--label", "b"]
    )
    assert "--label" in err


def test_unknown_flag_exits_2(capsys):
    err = run_error(capsys, ["--hf-model", "m", "--no-such-flag"])
    assert "unrecognized arguments" in err


def test_compare_arguments(capsys, tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"model": "m"}))
    assert "two report files" in run_error(capsys, ["--compare", one])
    assert "missing keys" in run_error(capsys, ["--compare", one, one])
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{")
    assert "not valid JSON" in run_error(capsys, ["--compare", garbage, garbage])
    assert "no such report" in run_error(
        capsys, ["--compare", tmp_path / "x.json", tmp_path / "y.json"]
    )


def test_transformers_not_installed(capsys, monkeypatch, text, tiny_hf_model):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    err = run_error(capsys, ["--hf-model", tiny_hf_model, "--text-file", text])
    assert "transformers is not installed" in err
    assert "pip install --no-build-isolation -e \".[hf]\"" in err


def test_subprocess_error_is_one_line(tmp_path, text):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "eval_jump.py"),
            "--hf-model",
            str(tmp_path / "nope"),
            "--text-file",
            str(text),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, repr(proc.stderr)
    assert proc.stderr.startswith("eval_jump: error: --hf-model")
