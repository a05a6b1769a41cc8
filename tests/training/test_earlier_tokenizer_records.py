"""Runs recorded before the tokenizer types took Megatron-LM core_v0.16.1's meanings:
``Llama2Tokenizer`` then wrote BOS before every document (now ``--legacy-tokenizer``'s ids)
and ``SentencePieceTokenizer`` meant ``GPTSentencePieceTokenizer``. Such a run's pinned
record (the sha256 of its tokenizer's ``unique_identifiers`` as they were then, with no
``ids``) is recognised: the type that gives its ids goes on, the other is refused in one
line naming the flag, and the tools read it with the tokenizer that gives its ids."""

import json
import os
import zlib
from types import SimpleNamespace

from test_pinned_run import one_line_error
from trainer_runs import base_args, train

from megatron_jreg.checkpoint.run_configs import build_run_tokenizer
from megatron_jreg.data.tokenizers.build import build_tokenizer, file_sha256
from megatron_jreg.data.tokenizers.records import earlier_record_fix, holds_same_ids, identity

TEXT = "The quick brown fox <EOD> jumps."


def earlier_identity(kind, model, vocab):
    """The record this project pinned for a sentencepiece model before records named ids."""
    return identity({"class": kind, "model_sha256": file_sha256(model), "vocab_size": vocab})


def configs(kind, model, pinned, vocab, legacy=None):
    data = SimpleNamespace(tokenizer_type=kind, tokenizer_model=model, tokenizer_identity=pinned)
    if legacy is not None:
        data.legacy_tokenizer = legacy
    return {"data": data, "model": SimpleNamespace(vocab_size=vocab)}


def test_an_earlier_llama2_record_names_legacy_tokenizer_and_the_tools_read_its_ids(demo_sp_data):
    _, model = demo_sp_data
    pinned = earlier_identity("Llama2Tokenizer", model, 2000)
    default = build_tokenizer("Llama2Tokenizer", model)
    legacy = build_tokenizer("Llama2Tokenizer", model, legacy=True)
    assert "--legacy-tokenizer" in earlier_record_fix(default, pinned)
    assert holds_same_ids(legacy, pinned) and not holds_same_ids(default, pinned)
    assert earlier_record_fix(legacy, pinned) is None
    # a saved run config of then has no legacy_tokenizer: read with BOS first, its ids
    tok = build_run_tokenizer(configs("Llama2Tokenizer", model, pinned, 2000))
    assert tok.encode(TEXT) == [tok.bos] + default.encode(TEXT)
    # records now say which ids they hold
    assert (default.unique_identifiers["ids"], legacy.unique_identifiers["ids"]) == (
        "megatron-core", "legacy")


def test_an_earlier_sentencepiece_record_is_gpt_sentencepiece_now(demo_sp_data):
    _, model = demo_sp_data
    pinned = earlier_identity("SentencePieceTokenizer", model, 2000)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", model)
    for legacy in (False, True):
        plain = build_tokenizer("SentencePieceTokenizer", model, legacy=legacy)
        assert "--tokenizer-type GPTSentencePieceTokenizer" in earlier_record_fix(plain, pinned)
    assert holds_same_ids(gpt, pinned) and earlier_record_fix(gpt, pinned) is None
    tok = build_run_tokenizer(configs("SentencePieceTokenizer", model, pinned, 2000))
    assert (tok.unique_identifiers["class"], tok.vocab_size) == ("GPTSentencePieceTokenizer", 2000)
    assert tok.encode(TEXT) == gpt.encode(TEXT)


def rewrite_as_earlier(iteration_dir, pinned):
    """The run config as it was saved before records named ids: the earlier identity and
    no legacy_tokenizer; the manifest's crc32 and size follow the file."""
    path = os.path.join(iteration_dir, "run_config.yaml")
    lines = open(path).read().splitlines(keepends=True)
    kept = [f"  tokenizer_identity: {pinned}\n" if "tokenizer_identity:" in line else line
            for line in lines if "legacy_tokenizer:" not in line]
    body = "".join(kept).encode()
    with open(path, "wb") as f:
        f.write(body)
    manifest_path = os.path.join(iteration_dir, "jreg_manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"]["run_config.yaml"] = {"crc32": zlib.crc32(body), "size": len(body)}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def test_a_checkpoint_of_earlier_llama2_ids_resumes_with_legacy_tokenizer_only(demo_sp_data,
                                                                             tmp_path):
    prefix, model = demo_sp_data
    save = str(tmp_path / "ck")
    flags = dict(tokenizer_type="Llama2Tokenizer", tokenizer_model=model, lr_decay_iters=4)
    train(base_args(prefix, train_iters=2, save=save, legacy_tokenizer=True, **flags))
    rewrite_as_earlier(os.path.join(save, "iter_0000002"),
                       earlier_identity("Llama2Tokenizer", model, 2000))
    proc = train(base_args(prefix, train_iters=4, load=save, save=save, **flags), check=False)
    one_line_error(proc, f"--load {save}: that run's data has Llama2Tokenizer's earlier ids",
                   "pass --legacy-tokenizer")
    proc = train(base_args(prefix, train_iters=4, load=save, save=save, legacy_tokenizer=True,
                           **flags))
    assert "iteration        4/4" in proc.stdout


def test_a_resume_that_turns_legacy_tokenizer_on_or_off_is_named(demo_sp_data, tmp_path):
    """A run saved with --legacy-tokenizer, resumed without it (or the reverse), is refused in
    one line naming the flag, not as a changed tokenizer file; --use-checkpoint-args takes the
    setting from the checkpoint with the rest of the tokenizer."""
    from megatron_jreg.data.tokenizers.build import tokenizer_identity
    from megatron_jreg.data.tokenizers.records import other_ids_fix

    prefix, model = demo_sp_data
    default = build_tokenizer("SentencePieceTokenizer", model)
    legacy = build_tokenizer("SentencePieceTokenizer", model, legacy=True)
    assert other_ids_fix(default, tokenizer_identity(legacy)).endswith("pass --legacy-tokenizer")
    assert other_ids_fix(legacy, tokenizer_identity(default)).endswith("drop --legacy-tokenizer")
    assert other_ids_fix(default, tokenizer_identity(default)) is None
    gpt = build_tokenizer("GPTSentencePieceTokenizer", model)
    assert other_ids_fix(gpt, tokenizer_identity(legacy)) is None  # no ids of two kinds

    save = str(tmp_path / "ck")
    flags = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model,
                 lr_decay_iters=4)
    train(base_args(prefix, train_iters=2, save=save, legacy_tokenizer=True, **flags))
    proc = train(base_args(prefix, train_iters=3, load=save, save=save, **flags), check=False)
    one_line_error(proc, f"--load {save}: its run used --legacy-tokenizer",
                   "pass --legacy-tokenizer")
    args = base_args(prefix, train_iters=3, load=save, save=save, lr_decay_iters=4,
                     use_checkpoint_args=True, model_preset=None, seq_length=None,
                     tokenizer_type=None)
    proc = train(args)
    assert "iteration        3/3" in proc.stdout
