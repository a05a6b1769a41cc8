"""What a checkpoint says its model is (run_config.yaml's model section, Megatron-LM's args
in common.pt) is typed and compared with the tensor shapes its own .metadata lists before
any model is built or tensor read; the YAML it carries is read with --config's bounds
(issue 46, items 3 to 5).

- The attacks: run_config.yaml's ``model.num_layers: 100000`` over tensors of 4 layers (the
  old reader built 7.5 GB for 86 s), Megatron-LM's ``args.num_layers`` 10**9 (a MemoryError
  traceback) and 10**5, ``args.num_attention_heads = "4"`` (a TypeError traceback), an
  alias bomb in run_config.yaml's ``data.tokenizer_type`` (expanded by the error message's
  repr). Each ends in one line naming the field, its value and what the tensors hold; the
  tools run in a subprocess under an address-space cap and a timeout, so a regression fails
  rather than eating the machine (eval_jump --load, the trainer's --load and
  --use-checkpoint-args; formats.read is the one place every reader goes through).
- The reference for "what the tensors hold" is the saved .metadata itself: the shapes a
  ModelConfig makes (model.weight_shapes) equal the ones the trainer saved, key for key.
- A .metadata listing tensors bigger than its shard files is not believed either.
- A fresh run whose model cannot fit says the model's size, not "lower --seq-length".
"""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import subprocess
import sys
import time

import pytest
import torch
import yaml

import megatron_jreg
from megatron_jreg.checkpoint import formats
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir
from megatron_jreg.checkpoint.manifest import write_manifest
from megatron_jreg.errors import UserError

# the tree whose code is under test (a copy of this file may test another checkout)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_jreg.__file__)))
MEMORY_CAP = 4 * 1024 ** 3
ITERATION = 3
PROJ = "decoder.layers.self_attention.linear_proj.weight"


def _copy(checkpoint, tmp_path):
    """(root, iteration directory) of a copy of the fixture's save directory."""
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    return str(root), iteration_dir(str(root), ITERATION)


def _edit_run_config(path, edit):
    """run_config.yaml of ``path`` changed by ``edit(dict)`` (or replaced by ``edit``'s text),
    the manifest rewritten to match, as an edited or crafted copy ships it."""
    file = os.path.join(path, "run_config.yaml")
    if isinstance(edit, str):
        text = edit
    else:
        with open(file) as f:
            data = yaml.safe_load(f)
        edit(data)
        text = yaml.safe_dump(data, sort_keys=False)
    with open(file, "w") as f:
        f.write(text)
    write_manifest(path)
    return file


def _megatron_lm_form(path, **args):
    """``path`` as Megatron-LM leaves it (no run_config.yaml, no marker or manifest: the
    architecture is in common.pt's args), with ``args`` set in those args."""
    for name in ("run_config.yaml", "jreg_manifest.json", "jreg_complete.json"):
        os.remove(os.path.join(path, name))
    file = os.path.join(path, "common.pt")
    common = torch.load(file, weights_only=False)  # the fixture's own file
    common.pop("train_state")  # ours; Megatron-LM counts samples in args
    for name, value in args.items():
        setattr(common["args"], name, value)
    torch.save(common, file)
    return file


def _refusal(root):
    with pytest.raises(UserError) as err:
        formats.read(root)
    message = str(err.value)
    assert "\n" not in message
    return message


def _capped(argv, timeout=90, cap=MEMORY_CAP):
    """``python ARGV`` in ROOT under an address-space cap; (proc, seconds)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv[:2]} still ran after {timeout} s instead of refusing the checkpoint")
    return proc, time.monotonic() - start


def _one_line(proc, seconds, *parts, limit=60):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines[-5:]
    for part in parts:
        assert part in lines[0], lines[0]
    assert seconds < limit, f"{seconds:.0f} s"
    return lines[0]


def _eval_jump(root, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat\n")
    return _capped(["tools/eval_jump.py", "--load", root, "--text-file", text, "--no-progress"])


def _train(argv):
    return _capped(["-m", "megatron_jreg.train", *argv])


def _use_checkpoint_args(root, demo_data):
    return ["--load", root, "--use-checkpoint-args", "--data-path", demo_data,
            "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters",
            str(ITERATION + 1), "--lr", "1e-3", "--eval-interval", "0"]


# ---- the reference: what the tensors hold is what a config makes ------------------------------


def test_the_shapes_a_config_makes_are_the_ones_the_trainer_saved(checkpoint):
    from megatron_jreg.model.weight_shapes import parameter_count, weight_shapes

    source = formats.read(checkpoint)
    saved = {k: v for k, v in source.opened.entries().items()
             if v is not None and not k.startswith("optimizer.")}
    model = source.format.configs["model"]
    assert weight_shapes(model) == saved
    assert parameter_count(model) == sum(torch.Size(s).numel() for s in saved.values())


# ---- item 3: the layer count claimed against the tensors --------------------------------------


def test_run_config_claiming_100000_layers_over_4_is_one_line(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_run_config(path, lambda d: d["model"].update(num_layers=100000))
    assert _refusal(root) == (
        f"{file}: model.num_layers is 100000, but {path}/.metadata lists tensors of 4 layers "
        f"({PROJ} is [4, 64, 64]); run_config.yaml does not describe these weights; restore "
        "the one saved with them")


@pytest.mark.parametrize("layers", [10**9, 10**5])
def test_megatron_lm_args_claiming_more_layers_is_one_line(checkpoint, tmp_path, layers):
    root, path = _copy(checkpoint, tmp_path)
    common = _megatron_lm_form(path, num_layers=layers)
    message = _refusal(root)
    assert message.startswith(f"{common}: args.num_layers is {layers}, but {path}/.metadata "
                              f"lists tensors of 4 layers ({PROJ} is [4, 64, 64])"), message


@pytest.mark.parametrize("field, value, named", [
    ("hidden_size", 128, "model.hidden_size is 128, but {meta} lists a hidden size of 64 "
                         "(embedding.word_embeddings.weight is [{rows}, 64])"),
    ("num_query_groups", 4, "model.num_attention_heads 4 with num_query_groups 4 makes "
                            "decoder.layers.self_attention.linear_qkv.weight [4, 192, 64], but "
                            "{meta} lists decoder.layers.self_attention.linear_qkv.weight "
                            "[4, 128, 64]"),
    ("ffn_hidden_size", 10**6, "model.ffn_hidden_size 1000000 with swiglu True, num_experts "
                               "None makes decoder.layers.mlp.linear_fc1.weight [4, 2000000, "
                               "64], but {meta} lists decoder.layers.mlp.linear_fc1.weight "
                               "[4, 384, 64]"),
    ("num_experts", 8, "model.ffn_hidden_size 192 with swiglu True, num_experts 8 makes no "
                       "decoder.layers.mlp.linear_fc1.weight, but {meta} lists "
                       "decoder.layers.mlp.linear_fc1.weight [4, 384, 64]"),
])
def test_each_size_claimed_is_compared_with_its_tensor(checkpoint, tmp_path, field, value, named):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_run_config(path, lambda d: d["model"].update({field: value}))
    meta = os.path.join(path, ".metadata")
    rows = formats.read(checkpoint).format.embedding_rows
    assert _refusal(root).startswith(f"{file}: " + named.format(meta=meta, rows=rows))


def test_metadata_listing_more_than_its_shards_hold_is_not_believed(checkpoint, tmp_path):
    """A .metadata (and run config) claiming 10**6 layers over shards of 4: refused from the
    bytes the shard files hold, before any build."""
    root, path = _copy(checkpoint, tmp_path)
    meta_file = os.path.join(path, ".metadata")
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)  # the fixture's own file
    for key, value in metadata.state_dict_metadata.items():
        if key.startswith("decoder.layers.") and getattr(value, "size", None) is not None:
            value.size = torch.Size([10**6, *value.size[1:]])
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    _edit_run_config(path, lambda d: d["model"].update(num_layers=10**6))
    message = _refusal(root)
    assert message.startswith(f"{meta_file} lists model tensors of ") and \
        "but its shard files hold" in message and "the directory is damaged" in message, message


# ---- item 4: args typed before they are used --------------------------------------------------


@pytest.mark.parametrize("field, value, kind", [
    ("num_attention_heads", "4", "an integer"),
    ("num_layers", 4.0, "an integer"),
    ("hidden_size", True, "an integer"),
    ("norm_epsilon", "1e-5", "a number"),
    ("tensor_model_parallel_size", "1", "an integer"),
    ("consumed_train_samples", "24", "an integer"),
    ("seed", [1234], "an integer"),
])
def test_a_megatron_lm_arg_of_the_wrong_type_is_one_line(checkpoint, tmp_path, field, value, kind):
    root, path = _copy(checkpoint, tmp_path)
    common = _megatron_lm_form(path, **{field: value})
    assert _refusal(root) == f"{common}: args.{field} is {value!r}, not {kind}"


def test_a_shared_nested_arg_is_shown_cut_short(checkpoint, tmp_path):
    """A few bytes of pickle (one list referenced twice, 60 levels deep) whose repr would
    be 2**60 elements long: the line shows its start."""
    nested = ["x"]
    for _ in range(60):
        nested = [nested, nested]
    root, path = _copy(checkpoint, tmp_path)
    common = _megatron_lm_form(path, num_attention_heads=nested)
    start = time.monotonic()
    message = _refusal(root)
    assert message.startswith(f"{common}: args.num_attention_heads is [[[")
    assert message.endswith(", not an integer") and len(message) < len(common) + 120
    assert time.monotonic() - start < 10


# ---- the readers, as run: one line under a memory cap -----------------------------------------


def test_eval_jump_load_refuses_100000_layers_claimed(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    _edit_run_config(path, lambda d: d["model"].update(num_layers=100000))
    proc, seconds = _eval_jump(root, tmp_path)
    _one_line(proc, seconds, "eval_jump: error: ", "model.num_layers is 100000",
              "lists tensors of 4 layers")


def test_eval_jump_load_refuses_megatron_lm_args_of_a_billion_layers(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    _megatron_lm_form(path, num_layers=10**9)
    proc, seconds = _eval_jump(root, tmp_path)
    _one_line(proc, seconds, "args.num_layers is 1000000000", "lists tensors of 4 layers")


def test_trainer_use_checkpoint_args_refuses_100000_layers_claimed(checkpoint, demo_data, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    _megatron_lm_form(path, num_layers=10**5)
    proc, seconds = _train(_use_checkpoint_args(root, demo_data))
    _one_line(proc, seconds, "args.num_layers is 100000", "lists tensors of 4 layers")


def test_trainer_use_checkpoint_args_refuses_a_string_head_count(checkpoint, demo_data, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    common = _megatron_lm_form(path, num_attention_heads="4")
    proc, seconds = _train(_use_checkpoint_args(root, demo_data))
    _one_line(proc, seconds, f"{common}: args.num_attention_heads is '4', not an integer")


# ---- item 5: the YAML a checkpoint carries is bounded as --config is --------------------------

# nine levels of ten aliases in data.tokenizer_type: 10**9 values once expanded
_BOMB = ("data:\n  tokenizer_type:\n"
         "    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
         + "".join(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9)))


def test_eval_jump_load_refuses_an_alias_bomb_in_run_config(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_run_config(path, _BOMB)
    proc, seconds = _eval_jump(root, tmp_path)
    _one_line(proc, seconds, file, "aliases expand to more than 100000 values")


def test_trainer_load_refuses_an_alias_bomb_in_run_config(checkpoint, demo_data, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_run_config(path, _BOMB)
    proc, seconds = _train(_use_checkpoint_args(root, demo_data)[:2] + [
        "--model-preset", "tiny", "--seq-length", "64", "--tokenizer-type", "ByteTokenizer",
        "--vocab-size", "512", "--data-path", demo_data, "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--eval-interval", "0"])
    _one_line(proc, seconds, file, "aliases expand to more than 100000 values")


def test_run_config_larger_than_a_settings_file_is_refused(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_run_config(path, "# padding\n" * 200_000)
    message = _refusal(root)
    assert file in message and "larger than 1 MiB" in message, message


# ---- a fresh run whose model does not fit -----------------------------------------------------


def test_a_model_too_big_for_memory_is_named_with_its_size(demo_data):
    """--num-layers 100000 of the tiny model: 4.9 billion parameters, 18.4 GiB of weights.
    Under a 2.5 GB cap they cannot fit: refused before the build, naming the model's size
    (was: built until 5 GB, then advice to lower --seq-length)."""
    proc, seconds = _capped(["-m", "megatron_jreg.train", "--model-preset", "tiny",
                             "--num-layers", "100000", "--seq-length", "64", "--data-path",
                             demo_data, "--tokenizer-type", "ByteTokenizer", "--micro-batch-size",
                             "4", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
                             "--eval-interval", "0"], timeout=120, cap=int(2.5 * 1024 ** 3))
    line = _one_line(proc, seconds, "the model does not fit",
                     "4.9 billion parameters", "18.4 GiB of weights", "lower --num-layers",
                     limit=120)
    assert "--seq-length" not in line and "out of memory" not in line  # before any allocation


def test_activations_out_of_memory_keep_the_batch_advice(demo_data):
    from megatron_jreg.commands.train import from_argv, out_of_memory_line

    experiment = from_argv(["--model-preset", "tiny", "--seq-length", "64", "--data-path",
                            demo_data, "--tokenizer-type", "ByteTokenizer", "--micro-batch-size",
                            "4", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3"])
    line = out_of_memory_line(MemoryError(), experiment)
    assert line == ("out of memory at --seq-length 64, --micro-batch-size 4; lower --seq-length "
                    "or --micro-batch-size (or split each sequence over more devices with "
                    "--context-parallel-size)")


def test_shapes_of_a_config_without_a_vocabulary():
    """A config before its tokenizer is known still has a size (its layers)."""
    from megatron_jreg.config.model import ModelConfig
    from megatron_jreg.model.weight_shapes import EMBEDDING, parameter_count, weight_shapes

    model = ModelConfig.from_preset("tiny")
    assert weight_shapes(model)[EMBEDDING] == (0, 64)
    assert parameter_count(model) > 0
