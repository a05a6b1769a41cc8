"""What a run is trained on is pinned: a resume names each architecture field that differs,
a different tokenizer is refused (by the trainer and by the tools reading a checkpoint)
naming both, and an explicit choice goes on, said once."""

import os
import shutil

import pytest
from trainer_runs import base_args, run_env, train

import forked_trainer


def tool(argv, check=True):
    proc = forked_trainer.run_tool(argv[0], argv[1:], run_env(), timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_line_error(proc, *words):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(err) == 1, err
    for word in words:
        assert word in err[0], err[0]
    assert "Traceback" not in proc.stderr and "lm loss" not in proc.stdout
    return err[0]


def sentencepiece(corpus, prefix, vocab):
    tool(["tools/train_tokenizer.py", "--input", corpus, "--model-prefix", prefix,
          "--vocab-size", str(vocab), "--overwrite"])
    return prefix + ".model"


@pytest.fixture(scope="module")
def byte_run(demo_data, tmp_path_factory):
    """A 2-step ByteTokenizer run saved at iteration 2, and the demo corpus beside its data."""
    save = str(tmp_path_factory.mktemp("pinned") / "byte")
    train(base_args(demo_data, train_iters=2, save=save))
    return save, os.path.join(os.path.dirname(demo_data), "corpus.jsonl")


@pytest.mark.parametrize("flags, named", [
    (dict(num_layers=3), "--num-layers 4 (this run: 3)"),
    (dict(hidden_size=96), "--hidden-size 64 (this run: 96)"),
    (dict(normalization="LayerNorm"), "--normalization RMSNorm (this run: LayerNorm)"),
    (dict(rotary_base=500), "--rotary-base 10000 (this run: 500)"),
    (dict(model_preset="qwen3-tiny"), "--qk-layernorm False (this run: True)"),
])
def test_resume_with_another_architecture_names_the_mismatch(byte_run, demo_data, flags, named):
    """Was: "cannot read checkpoint ...; it may be corrupt: load an earlier one with
    --ckpt-step"."""
    save, _ = byte_run
    proc = train(base_args(demo_data, train_iters=4, load=save, **flags), check=False)
    line = one_line_error(proc, f"--load {save}: the checkpoint's model differs", named)
    assert "corrupt" not in line


def test_resume_with_another_tokenizer_is_refused_naming_both(byte_run, demo_data, tmp_path):
    """A ByteTokenizer checkpoint resumed with a 380-piece SentencePiece tokenizer (whose ids
    fit the padded embedding of 384 rows) went on silently."""
    save, corpus = byte_run
    sp = sentencepiece(corpus, str(tmp_path / "sp"), 380)
    flags = dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp, train_iters=2)
    proc = train(base_args(demo_data, load=save, **flags), check=False)
    one_line_error(proc, "trained with tokenizer ByteTokenizer (259 ids",
                   "this run has GPTSentencePieceTokenizer (380 ids", "--allow-tokenizer-change")
    # the explicit override: the run goes on (fine-tuning the weights), saying so once
    out = str(tmp_path / "changed")
    proc = train(base_args(demo_data, pretrained_checkpoint=save, save=out,
                           allow_tokenizer_change=True, **flags))
    said = [line for line in proc.stdout.splitlines() if "--allow-tokenizer-change" in line]
    assert len(said) == 1 and "instead of the checkpoint's ByteTokenizer" in said[0], said
    run_config = open(os.path.join(out, "iter_0000002", "run_config.yaml")).read()
    assert "tokenizer_type: GPTSentencePieceTokenizer" in run_config


def test_eval_iters_zero_disables_validation_and_the_run_saves(demo_data, tmp_path):
    """Was: ZeroDivisionError at the first evaluation, before that iteration's save."""
    save = str(tmp_path / "ck")
    proc = train(base_args(demo_data, train_iters=2, eval_interval=1, eval_iters=0, save=save))
    # no validation line; the start-up line says validation is off
    said = [line for line in proc.stdout.lower().splitlines() if "validation" in line]
    assert said == ["--eval-interval 1: no validation with --eval-iters 0 (pass --eval-iters 1 "
                    "or more to validate)"], said
    assert os.path.isdir(os.path.join(save, "iter_0000002"))


@pytest.fixture(scope="module")
def sp_run(byte_run, demo_data, tmp_path_factory):
    """A 2-step run with a 380-piece SentencePiece tokenizer (its file at a path the test
    may retrain in place) and the corpus."""
    _, corpus = byte_run
    root = tmp_path_factory.mktemp("pinned_sp")
    sp = sentencepiece(corpus, str(root / "sp"), 380)
    save = str(root / "ck")
    train(base_args(demo_data, train_iters=2, save=save, tokenizer_type="GPTSentencePieceTokenizer",
                    tokenizer_model=sp))
    text = root / "eval.txt"
    text.write_text("the layer norm of the residual state\nanother short document here\n")
    return save, sp, corpus, str(text)


def test_tools_refuse_a_tokenizer_retrained_in_place(sp_run, tmp_path):
    """train_tokenizer.py over the run's --model-prefix, then eval_jump and convert_to_hf
    used the new tokenizer on the old weights with no word."""
    save, sp, corpus, text = sp_run
    kept = str(tmp_path / "kept.model")
    shutil.copyfile(sp, kept)
    try:
        sentencepiece(corpus, sp[:-len(".model")], 400)
        proc = tool(["tools/eval_jump.py", "--load", save, "--text-file", text,
                     "--seq-length", "32", "--no-progress"], check=False)
        one_line_error(proc, f"the run's tokenizer {sp} is now GPTSentencePieceTokenizer (400 ids",
                       "not the GPTSentencePieceTokenizer (380 ids", "--tokenizer-model")
        proc = tool(["tools/convert_to_hf.py", "--load", save, "--output",
                     str(tmp_path / "hf")], check=False)
        one_line_error(proc, "(400 ids", "(380 ids")
        assert not os.path.exists(tmp_path / "hf")
        # an explicit --tokenizer-model is used as asked, with one warning
        proc = tool(["tools/eval_jump.py", "--load", save, "--text-file", text,
                     "--seq-length", "32", "--no-progress", "--tokenizer-model", sp])
        warned = [line for line in proc.stderr.splitlines() if "using it as asked" in line]
        assert len(warned) == 1, proc.stderr
        # the tokenizer the run trained with, moved: no word
        proc = tool(["tools/eval_jump.py", "--load", save, "--text-file", text,
                     "--seq-length", "32", "--no-progress", "--tokenizer-model", kept])
        assert "as asked" not in proc.stderr
    finally:
        shutil.copyfile(kept, sp)


def test_pretrained_checkpoint_that_is_a_file_says_so(byte_run, demo_data, tmp_path):
    """Was: "--pretrained-checkpoint FILE does not exist" for a file that exists."""
    save, _ = byte_run
    file = os.path.join(save, "iter_0000002", "run_config.yaml")
    proc = train(base_args(demo_data, pretrained_checkpoint=file), check=False)
    one_line_error(proc, "is a file, not a checkpoint directory", "--save")


def test_eval_jump_seq_length_beyond_learned_positions(demo_data, tmp_path):
    """A GPT-2 form checkpoint (learned positions for 64 tokens) measured at --seq-length
    128: was an IndexError traceback from the position embedding."""
    save = str(tmp_path / "gpt2")
    train(base_args(demo_data, model_preset="gpt2-tiny", train_iters=2, save=save))
    text = tmp_path / "eval.txt"
    text.write_text("x" * 300 + "\n")
    proc = tool(["tools/eval_jump.py", "--load", save, "--text-file", str(text),
                 "--seq-length", "128", "--no-progress"], check=False)
    one_line_error(proc, "--seq-length 128: the model has learned positions for 64 tokens only")


@pytest.mark.parametrize("split", ["0,0,100", "0,100,0"])
def test_a_split_without_train_weight_is_refused(demo_data, split):
    """Was: TypeError "object of type 'NoneType' has no len()" in rank_microbatches."""
    proc = train(base_args(demo_data, train_iters=2, split=split), check=False)
    one_line_error(proc, f"--split {split} gives the train split no weight")


def test_seq_length_one_is_refused_naming_the_flag(demo_data):
    """Was: numpy's "zero-size array to reduction operation minimum" from megatron-core."""
    proc = train(base_args(demo_data, train_iters=2, seq_length=1), check=False)
    one_line_error(proc, "--seq-length must be >= 2, got 1")


def test_resume_names_a_tokenizer_file_changed_in_place(sp_run, demo_data, tmp_path):
    """The same path, other content: the fix is the file, not the flags (which were right)."""
    save, sp, corpus, _ = sp_run
    kept = str(tmp_path / "kept.model")
    shutil.copyfile(sp, kept)
    try:
        sentencepiece(corpus, sp[:-len(".model")], 400)
        proc = train(base_args(demo_data, model_preset=None, tokenizer_type=None, load=save,
                               use_checkpoint_args=True, train_iters=4), check=False)
        one_line_error(proc, f"the tokenizer {sp} changed since the checkpoint was trained",
                       "(380 ids", "now GPTSentencePieceTokenizer (400 ids", "restore the file")
    finally:
        shutil.copyfile(kept, sp)


def test_a_checkpoint_saved_before_the_pin_is_checked_by_its_recorded_tokenizer(
        byte_run, demo_data, tmp_path):
    """Its run config has no tokenizer identity: the recorded tokenizer, built, gives it (was:
    a ByteTokenizer checkpoint resumed with a SentencePiece tokenizer silently)."""
    save, corpus = byte_run
    old = str(tmp_path / "old")
    shutil.copytree(save, old)
    config = os.path.join(old, "iter_0000002", "run_config.yaml")
    lines = open(config).read().splitlines(keepends=True)
    open(config, "w").write("".join(line for line in lines if "tokenizer_identity" not in line))
    sp = sentencepiece(corpus, str(tmp_path / "sp"), 380)
    proc = train(base_args(demo_data, load=old, no_verify_checkpoint=True, train_iters=4,
                           tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp),
                 check=False)
    one_line_error(proc, "trained with tokenizer ByteTokenizer (259 ids",
                   "this run has GPTSentencePieceTokenizer (380 ids")
