"""What our checkpoints carry for Megatron-LM, and Transformer Engine shaped and local-spec
models loading each other's checkpoints at TP1 and TP2."""

import json
import os
import subprocess
import sys

import pytest
import torch
from trainer_runs import REPO, base_args, run_env, train

from megatron_jreg.checkpoint import formats
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir
from megatron_jreg.checkpoint.megatron_lm_args import sections_from_args
from megatron_jreg.checkpoint.state_keys import compare
from megatron_jreg.training.checkpoint_args import architecture_differences

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = os.path.join(HERE, "megatron_lm_loader_fields.txt")


def loader_fields():
    """(name, required) of each args field Megatron-LM's loaders read (recorded list)."""
    rows = [line.split() for line in open(FIELDS) if line.strip() and not line.startswith("#")]
    return [(row[0], row[1] == "required") for row in rows]


def megatron_lm_padded_vocab(vocab, divisible_by, tp):
    """Megatron-LM's _vocab_size_with_padding."""
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


@pytest.mark.parametrize("fully", [False, True], ids=["default", "fully_reshardable_flag"])
def test_checkpoint_carries_what_megatron_lm_reads(demo_data, tmp_path, fully):
    save = tmp_path / "ckpt"
    train(base_args(demo_data, save=save, train_iters=2, seq_length=32,
                    use_distributed_optimizer=True,
                    dist_ckpt_optim_fully_reshardable=fully or None))
    path = iteration_dir(str(save), 2)
    common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 2
    args, run = common["args"], formats.read(str(save), 2).format.configs
    fields = loader_fields()
    assert len(fields) == 72
    assert [n for n, _ in fields if not hasattr(args, n)] == []
    assert [n for n, required in fields if required and getattr(args, n) is None] == []
    m = run["model"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == \
        (m.num_layers, m.hidden_size, m.num_attention_heads, 32)
    assert (args.fp16, args.bf16, args.sequence_parallel, args.tensor_model_parallel_size) == \
        (False, False, False, 1)
    # check_checkpoint_args compares it with Megatron-LM's own command line: its default
    # (True, with RoPE too) unless the run gave --no-position-embedding
    assert args.add_position_embedding is True
    assert args.padded_vocab_size == m.padded_vocab == 384
    # Megatron-LM pads the tokenizer's vocabulary to the rows this checkpoint holds
    assert megatron_lm_padded_vocab(m.vocab_size, args.make_vocab_size_divisible_by,
                                    args.tensor_model_parallel_size) == args.padded_vocab_size
    assert args.consumed_train_samples == 16 and args.use_distributed_optimizer
    assert args.dist_ckpt_optim_fully_reshardable == fully
    expected = "fully_reshardable" if fully else "dp_reshardable"
    assert common["content_metadata"]["distrib_optim_sharding_type"] == expected
    schedule = common["opt_param_scheduler"]
    assert schedule["num_steps"] == 16 and schedule["max_lr"] == 3e-3
    assert common["num_floating_point_operations_so_far"] > 0
    # the args alone rebuild the architecture (a checkpoint without run_config.yaml)
    assert architecture_differences(sections_from_args(args, path)["model"], m) == []
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    rng = [v for k, v in load_sharded_metadata(path).items() if k.startswith("rng_state/")]
    assert [tuple(v.global_shape) for v in rng] == [(1, 1)]
    assert not os.path.exists(os.path.join(path, "rng"))


@pytest.mark.parametrize("tp", [1, 2])
def test_te_shaped_and_local_models_load_each_others_checkpoints(demo_data, tmp_path, tp):
    save = tmp_path / "run"
    train(base_args(demo_data, save=save, train_iters=2, seq_length=32))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(tp)]
    proc = subprocess.run(launcher + [os.path.join(HERE, "te_local_worker.py"), str(save),
                                      str(tmp_path / "te")], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("te_from_local", "local_from_te", "te_from_te"):
        assert report[name]["equal"], name
    assert "this model's _extra_state entries (decoder.layers.self_attention.core_attention." \
        "_extra_state) (Transformer Engine's FP8 metadata) are not in the checkpoint" in \
        report["te_from_local"]["printed"]
    assert "the checkpoint's _extra_state entries (decoder.layers.self_attention." \
        "core_attention._extra_state) are not used by this model" \
        in report["local_from_te"]["printed"]
    assert "_extra_state" not in report["te_from_te"]["printed"]
    assert report["te_extra_state_loaded"]


def test_compare_names_what_does_not_fit():
    """Everything but a one-sided _extra_state is named: missing, unexpected, misshapen."""
    stored = {"embedding.word_embeddings.weight": (384, 64),
              "decoder.layers.self_attention.linear_qkv.weight": (4, 128, 64),
              "decoder.layers.mlp.linear_fc2.weight": (4, 64, 192),
              "decoder.layers.self_attention.core_attention._extra_state": None,
              "optimizer.state.exp_avg.embedding.word_embeddings.weight": (384, 64),
              "rng_state": None}
    asked = {"embedding.word_embeddings.weight": (384, 64),
             "decoder.layers.self_attention.linear_qkv.weight": (2, 128, 64),
             "decoder.layers.self_attention.q_layernorm.weight": (2, 16),
             "decoder.layers.mlp.linear_fc1._extra_state": None}
    result = compare(asked, stored)
    assert result.missing == ["decoder.layers.self_attention.q_layernorm.weight"]
    assert result.unexpected == ["decoder.layers.mlp.linear_fc2.weight"]
    assert result.shapes == ["decoder.layers.self_attention.linear_qkv.weight: checkpoint "
                             "(4, 128, 64), this model (2, 128, 64)"]
    assert result.extra_missing == {"decoder.layers.mlp.linear_fc1._extra_state"}
    assert result.extra_unused == ["decoder.layers.self_attention.core_attention._extra_state"]
    assert result.problem() == (
        "the checkpoint lacks decoder.layers.self_attention.q_layernorm.weight; the checkpoint "
        "holds entries this model does not have: decoder.layers.mlp.linear_fc2.weight; shapes "
        "differ: decoder.layers.self_attention.linear_qkv.weight: checkpoint (4, 128, 64), this "
        "model (2, 128, 64)")
    only_extra = compare({"decoder.layers.mlp.linear_fc1._extra_state": None},
                         {"decoder.layers.self_attention.core_attention._extra_state": None})
    assert only_extra.problem() is None and len(only_extra.notes()) == 2


def test_args_of_a_model_this_project_cannot_build_are_named():
    """Megatron-LM's args: run flags (--mock-data) are no refusal; a model flag is."""
    import types

    from megatron_jreg.errors import InputError

    args = types.SimpleNamespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                                 seq_length=32, padded_vocab_size=256, mock_data=True,
                                 tokenizer_type="NullTokenizer", vocab_size=255)
    sections = sections_from_args(args, "ckpt/iter_0000004")
    assert sections["model"].num_layers == 2 and sections["model"].vocab_size == 256
    args.squared_relu = True
    with pytest.raises(InputError, match="ckpt/iter_0000004: the checkpoint's model uses "
                                         "--squared-relu"):
        sections_from_args(args, "ckpt/iter_0000004")


def test_use_checkpoint_args_with_a_null_tokenizer(tmp_path):
    """NullTokenizer's --vocab-size counts the ids before its EOD, the saved vocabulary
    counts the EOD too: --use-checkpoint-args takes the checkpoint's tokenizer, or agrees
    with the same --vocab-size given again (Megatron-LM's mock-data runs use this tokenizer)."""
    import random

    import forked_trainer

    random.seed(0)
    jsonl = tmp_path / "ids.jsonl"
    jsonl.write_text("".join(json.dumps({"text": " ".join(str(random.randrange(255))
                                                          for _ in range(64))}) + "\n"
                             for _ in range(200)))
    proc = forked_trainer.run_tool("tools/preprocess_data.py", [
        "--input", str(jsonl), "--output-prefix", str(tmp_path / "ids"), "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "255", "--append-eod", "--workers", "1"], run_env(),
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = str(tmp_path / "ids_text_document")
    null = dict(tokenizer_type="NullTokenizer", vocab_size=255)
    train(base_args(data, save=tmp_path / "run", train_iters=2, seq_length=32, **null))
    for extra in ({"tokenizer_type": None}, null):
        proc = train(base_args(data, model_preset=None, pretrained_checkpoint=tmp_path / "run",
                               use_checkpoint_args=True, train_iters=1, seq_length=32, **extra))
        assert "fine-tuning from --pretrained-checkpoint" in proc.stdout
