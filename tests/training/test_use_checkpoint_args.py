"""--pretrained-checkpoint CKPT --use-checkpoint-args: training from an imported Hugging
Face model without its flags, at any layout, with and without JREG.

The model is a tiny random Llama (tied embeddings, GQA) with SmolLM2's real tokenizer,
imported with tools/convert_from_hf.py; the data is the demo corpus tokenized with the
tokenizer the checkpoint carries.
"""

import json
import os
import shutil

import pytest
import torch
import yaml
from trainer_runs import read_metrics, run_env, train

import forked_trainer
from session_cache import build_once


def _run(cmd):
    proc = forked_trainer.run_tool(cmd[0], cmd[1:], run_env(), timeout=600)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _build_import(root, smollm2_hf):
    import transformers

    hf_dir = os.path.join(str(root), "hf")
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    transformers.AutoTokenizer.from_pretrained(smollm2_hf).save_pretrained(hf_dir)
    ckpt = os.path.join(str(root), "ckpt")
    _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", ckpt])
    corpus, prefix = os.path.join(str(root), "corpus.jsonl"), os.path.join(str(root), "text")
    _run(["tools/make_demo_corpus.py", "--output", corpus, "--max-docs", "200"])
    _run(["tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
          os.path.join(ckpt, "iter_0000000", "tokenizer"), "--append-eod", "--workers", "1"])
    return {"ckpt": ckpt, "data": prefix + "_text_document"}


@pytest.fixture(scope="module")
def imported(smollm2_hf, tmp_path_factory):
    return build_once(tmp_path_factory, "imported_tiny_llama",
                      lambda root: _build_import(root, smollm2_hf))


def _args(imported, tmp_path, name, *extra, iters=3, lam=1.0):
    return ["--pretrained-checkpoint", imported["ckpt"], "--use-checkpoint-args",
            "--data-path", imported["data"], "--seq-length", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3",
            "--log-interval", "1", "--eval-interval", "0", "--jreg-lambda", str(lam),
            "--seed", "1234", "--metrics-file", str(tmp_path / f"{name}.jsonl"),
            "--save", str(tmp_path / name), *extra]


def test_architecture_and_tokenizer_come_from_the_checkpoint(imported, tmp_path):
    proc = train(_args(imported, tmp_path, "tp1"))
    assert "fine-tuning from --pretrained-checkpoint" in proc.stdout
    saved = yaml.safe_load(open(tmp_path / "tp1" / "iter_0000003" / "run_config.yaml"))
    imported_cfg = yaml.safe_load(open(os.path.join(imported["ckpt"], "iter_0000000",
                                                    "run_config.yaml")))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "rotary_base", "norm_epsilon",
                "untie_embeddings_and_output_weights", "vocab_size"):
        assert saved["model"][key] == imported_cfg["model"][key], key
    assert saved["model"]["num_layers"] == 4
    assert saved["model"]["untie_embeddings_and_output_weights"] is False
    assert saved["model"]["seq_length"] == 64
    assert saved["data"]["tokenizer_type"] == "HuggingFaceTokenizer"
    # the save carries the tokenizer it trained with
    carried = tmp_path / "tp1" / "iter_0000003" / "tokenizer" / "tokenizer.json"
    assert carried.read_bytes() == open(os.path.join(
        imported["ckpt"], "iter_0000000", "tokenizer", "tokenizer.json"), "rb").read()
    rows = read_metrics(tmp_path / "tp1.jsonl")
    assert len(rows) == 3 and all(r["jreg_penalty"] > 0 for r in rows)


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_any_layout_trains_the_same_model(imported, tmp_path, layout):
    one = read_metrics_of(train(_args(imported, tmp_path, "one")), tmp_path / "one.jsonl")
    two = read_metrics_of(train(_args(imported, tmp_path, "two", *layout), nproc=2),
                          tmp_path / "two.jsonl")
    for a, b in zip(one, two):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["jreg_penalty"] == pytest.approx(a["jreg_penalty"], rel=1e-4)


def read_metrics_of(proc, path):
    assert proc.returncode == 0
    return read_metrics(path)


def test_with_and_without_jreg_start_from_the_same_weights(imported, tmp_path):
    base = read_metrics_of(train(_args(imported, tmp_path, "base", lam=0.0)),
                           tmp_path / "base.jsonl")
    jreg = read_metrics_of(train(_args(imported, tmp_path, "jreg", lam=1.0)),
                           tmp_path / "jreg.jsonl")
    # step 1's forward runs the imported weights in both: the same LM loss and Psi
    assert jreg[0]["lm_loss"] == pytest.approx(base[0]["lm_loss"], rel=1e-6)
    assert jreg[0]["psi"] == pytest.approx(base[0]["psi"], rel=1e-6)
    assert base[0]["jreg_penalty"] == 0 and jreg[0]["jreg_penalty"] > 0
    # then the penalty's gradient moves the JREG run elsewhere
    assert abs(jreg[-1]["lm_loss"] - base[-1]["lm_loss"]) > 1e-6


@pytest.mark.parametrize("flags,message", [
    (["--num-layers", "3"], "--num-layers 3 differs from the checkpoint's 4 (--use-checkpoint-args "
                            "takes the architecture from --pretrained-checkpoint"),
    (["--hidden-size", "64"], "--hidden-size 64 differs from the checkpoint's 32"),
    (["--model-preset", "tiny"], "--model-preset tiny conflicts with --use-checkpoint-args"),
    (["--seq-length", "512"],
     "--seq-length 512 exceeds the checkpoint's --max-position-embeddings 256"),
])
def test_a_conflicting_architecture_flag_is_refused_by_name(imported, tmp_path, flags, message):
    proc = train(_args(imported, tmp_path, "bad", *flags), check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert message in last, last
    assert not (tmp_path / "bad").exists()


def test_an_agreeing_flag_is_accepted_and_a_missing_checkpoint_named(imported, tmp_path):
    proc = train(_args(imported, tmp_path, "same", "--num-layers", "4", iters=1))
    assert proc.returncode == 0
    argv = [a for a in _args(imported, tmp_path, "none", iters=1)]
    i = argv.index("--pretrained-checkpoint")
    del argv[i:i + 2]
    proc = train(argv, check=False)
    assert proc.returncode == 2
    assert ("--use-checkpoint-args reads the architecture from a checkpoint: pass --load"
            in proc.stderr)
    json.dumps(proc.stderr)  # one line of text, no traceback
    assert "Traceback" not in proc.stderr


def test_load_of_the_import_says_weights_only_not_corrupt(imported, tmp_path):
    """Was: --load IMPORT --use-checkpoint-args failed at the load with 'it may be corrupt:
    load an earlier one with --ckpt-step'. The conversion is named before any work, and a
    weights-only checkpoint without that mark (Megatron-LM's --no-save-optim) at the load."""
    argv = _args(imported, tmp_path, "resumed", iters=1)
    argv[argv.index("--pretrained-checkpoint")] = "--load"
    proc = train(argv, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: --load {imported['ckpt']}: a checkpoint converted from Hugging "
                          "Face (") and err.endswith(
        f"holds weights only, no run to resume; start from it with --pretrained-checkpoint "
        f"{imported['ckpt']} instead of --load"), err
    assert "corrupt" not in proc.stderr and "iteration" not in proc.stdout
    unmarked = tmp_path / "unmarked"
    shutil.copytree(imported["ckpt"], unmarked)
    config = unmarked / "iter_0000000" / "run_config.yaml"
    config.write_text("".join(line for line in config.read_text().splitlines(keepends=True)
                              if "imported_from" not in line))
    argv[argv.index("--load") + 1] = str(unmarked)
    proc = train(argv + ["--no-verify-checkpoint"], check=False)  # the run config changed
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err == (f"error: checkpoint {unmarked / 'iter_0000000'} holds weights only, no "
                   "optimizer state to resume: start from its weights with "
                   f"--pretrained-checkpoint {unmarked} (or pass --no-load-optim)"), err


def test_sft_from_the_import_at_tp2_equals_one_rank(imported, tmp_path):
    tokenizer = os.path.join(imported["ckpt"], "iter_0000000", "tokenizer")
    chat, prefix = tmp_path / "chat.jsonl", tmp_path / "chat"
    _run(["tools/make_demo_corpus.py", "--chat", "--output", chat, "--max-docs", "60"])
    _run(["tools/preprocess_data.py", "--sft", "--input", chat, "--output-prefix", prefix,
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
          "--workers", "1"])

    def sft_args(name):
        argv = _args(imported, tmp_path, name, "--sft", "--split", "90,10,0")
        argv[argv.index("--data-path") + 1] = str(prefix) + "_sft_document"
        argv[argv.index("--seq-length") + 1] = "128"
        return argv

    one = read_metrics_of(train(sft_args("sft1")), tmp_path / "sft1.jsonl")
    two = read_metrics_of(train(sft_args("sft2") + ["--tensor-model-parallel-size", "2"], nproc=2),
                          tmp_path / "sft2.jsonl")
    assert len(one) == 3 and all(r["jreg_penalty"] > 0 for r in one)
    for a, b in zip(one, two):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
