"""What the attack pass on the checkpoint pipeline found, each refused in one line where every
reader goes through (``formats.read``: the catalog, the trusted open, the descriptor):

- a ``.metadata`` that unpickles, under its allow-list, into something that is not
  dist-checkpointing's index (a root of nested lists; the allow-listed ``Metadata`` built
  with wrong arguments; a field of the wrong type, a chunk past its tensor, a chunk with no
  storage record) is named as damaged, never an AttributeError where a field is first used;
- the line for a checkpoint file that does not read as dist-checkpointing's reads right for
  each file it is built for (``.metadata``, ``common.pt``, a shard's byte entry);
- a value of the wrong kind in a checkpoint's ``run_config.yaml`` (``num_layers: "4"``) is
  named with the field, its value and the kind expected, also by the trainer's
  ``--use-checkpoint-args``;
- a tracker that is not ASCII digits is shown escaped (``'\\u0664'``, not ``'��'``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

import megatron_jreg
from megatron_jreg.checkpoint import catalog, faults, formats, safe_pickle
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir
from megatron_jreg.checkpoint.manifest import write_manifest
from megatron_jreg.errors import UserError

# the tree whose code is under test (a copy of this file may test another checkout)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_jreg.__file__)))
ITERATION = 3
TAIL = ("it was not written by dist-checkpointing, or the directory is damaged: load an earlier "
        "one with")


def _copy(checkpoint, tmp_path):
    """(root, iteration directory) of a copy of the fixture's save directory."""
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    return str(root), iteration_dir(str(root), ITERATION)


def _refusal(root, kind=UserError):
    with pytest.raises(kind) as err:
        formats.read(root)
    message = str(err.value)
    assert "\n" not in message, message
    return err.value, message


def _genuine_metadata(path):
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        return safe_pickle.read_metadata(f, file)


def _write_metadata(path, data: bytes) -> str:
    """``.metadata`` of ``path`` replaced by ``data``, the manifest rewritten to match (what a
    crafted copy ships), so the refusal is the reader's, not the checksum's."""
    file = os.path.join(path, ".metadata")
    with open(file, "wb") as f:
        f.write(data)
    write_manifest(path)
    return file


# ---- 1, 2: a .metadata that is not dist-checkpointing's index ------------------------------------

NESTED_LISTS = b"\x80\x04" + b"]" * 10 ** 5 + b"a" * (10 ** 5 - 1) + b"."
# REDUCE of the allow-listed Metadata with ("abc", 5, 6): state_dict_metadata "abc"
REDUCED_METADATA = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n"
                    b"(X\x03\x00\x00\x00abcK\x05K\x06tR.")


def _first_tensor(meta):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return next(v for v in meta.state_dict_metadata.values()
                if isinstance(v, TensorStorageMetadata))


def _set(meta, name, value):
    setattr(meta, name, value)


def _chunk_past_size(meta):
    chunk = _first_tensor(meta).chunks[0]
    chunk.sizes = torch.Size([d + 1 for d in chunk.sizes])


def _chunk_without_storage(meta):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    entry = _first_tensor(meta)
    key = next(k for k, v in meta.state_dict_metadata.items() if v is entry)
    del meta.storage_data[MetadataIndex(key, entry.chunks[0].offsets)]


def _storage_path_int(meta):
    next(iter(meta.storage_data.values())).relative_path = 7


EDITS = {
    "state_dict_metadata_int": (lambda m: _set(m, "state_dict_metadata", 5),
                                "its state_dict_metadata is an int, not a dict"),
    "entry_a_list": (lambda m: m.state_dict_metadata.__setitem__("x", [1]),
                     "its state_dict_metadata['x'] is a list, not TensorStorageMetadata or "
                     "BytesStorageMetadata"),
    "storage_data_list": (lambda m: _set(m, "storage_data", [1, 2]),
                          "its storage_data is a list, not a dict or None"),
    "storage_meta_str": (lambda m: _set(m, "storage_meta", "x"),
                         "its storage_meta is a str, not StorageMeta or None"),
    "planner_data_int": (lambda m: _set(m, "planner_data", 3),
                         "its planner_data is an int, not a dict or None"),
    "size_negative": (lambda m: _set(_first_tensor(m), "size", torch.Size([-1, 4])),
                      ".size [-1, 4] has a dimension below 0"),
    "chunks_empty": (lambda m: _set(_first_tensor(m), "chunks", []),
                     "chunks is empty, not a list of its chunks"),
    "chunk_past_size": (_chunk_past_size, "reaches past the tensor's size"),
    "chunk_without_storage": (_chunk_without_storage, ".chunks[0] has no storage record"),
    "storage_path_int": (_storage_path_int, ".relative_path is an int, not a file name"),
}


def test_a_genuine_metadata_still_opens(checkpoint, tmp_path):
    """The control: the trainer's own .metadata passes every check, re-pickled too."""
    root, path = _copy(checkpoint, tmp_path)
    _write_metadata(path, pickle.dumps(_genuine_metadata(path)))
    source = formats.read(root)
    source.opened.check_shards(verify=True)
    assert source.iteration == ITERATION and source.format.embedding_rows >= 256


@pytest.mark.parametrize("data,why", [
    (NESTED_LISTS, "its root is a list, not dist-checkpointing's Metadata"),
    (REDUCED_METADATA, "its state_dict_metadata is a str, not a dict"),
], ids=["nested_lists", "reduce_metadata_wrong_args"])
def test_a_metadata_that_is_not_an_index_is_damaged_in_one_line(checkpoint, tmp_path, data, why):
    root, path = _copy(checkpoint, tmp_path)
    file = _write_metadata(path, data)
    err, message = _refusal(root, faults.DamagedFile)
    assert message == (f"cannot read checkpoint file {file} ({why}); {TAIL} --ckpt-step"), message
    # the tools' wording of the same fault names their flag
    assert faults.phrase(err, faults.TOOLS).endswith(f"{TAIL} --iteration")


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_metadata_field_of_the_wrong_shape_is_damaged_in_one_line(checkpoint, tmp_path, edit):
    root, path = _copy(checkpoint, tmp_path)
    meta = _genuine_metadata(path)
    change, why = EDITS[edit]
    change(meta)
    file = _write_metadata(path, pickle.dumps(meta))
    _, message = _refusal(root, faults.DamagedFile)
    assert message.startswith(f"cannot read checkpoint file {file} (its "), message
    assert why in message and message.endswith(f"{TAIL} --ckpt-step"), message


# ---- 3: the line of a file that does not read as dist-checkpointing's ---------------------------


def test_the_damaged_line_reads_right_for_each_file_it_is_built_for(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _write_metadata(path, b"\x80\x04")  # cut short: the unpickler's EOFError
    assert _refusal(root, faults.DamagedFile)[1] == (
        f"cannot read checkpoint file {file} (EOFError); {TAIL} --ckpt-step")

    root, path = _copy(checkpoint, tmp_path / "common")
    common = os.path.join(path, "common.pt")
    with open(common, "rb+") as f:  # cut short: torch's zip reader fails
        f.truncate(os.path.getsize(common) // 2)
    write_manifest(path)
    message = _refusal(root, faults.DamagedFile)[1]
    assert message.startswith(f"cannot read checkpoint file {common} (") and \
        message.endswith(f"); {TAIL} --ckpt-step"), message
    assert "'s or;" not in message

    shard = os.path.join(path, "__0_0.distcp")
    entry = safe_pickle.damaged(shard, EOFError("Ran out of input"), entry="rng_state/shard_0_1")
    assert str(entry) == (f"cannot read entry rng_state/shard_0_1 of checkpoint file {shard} "
                          f"(EOFError: Ran out of input); {TAIL} --ckpt-step")


# ---- 4: a value of the wrong kind in a checkpoint's run_config.yaml -----------------------------

FIX = "run_config.yaml was edited or damaged: restore the one saved with these weights"


def _edit_model(path, field, value) -> str:
    file = os.path.join(path, "run_config.yaml")
    with open(file) as f:
        data = yaml.safe_load(f)
    data["model"][field] = value
    with open(file, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    write_manifest(path)
    return file


@pytest.mark.parametrize("field,value,shown,kind", [
    ("num_layers", "4", "'4'", "an integer"),
    ("num_layers", [4], "[4]", "an integer"),
    ("num_layers", {"n": 4}, "{'n': 4}", "an integer"),
    ("hidden_size", "64", "'64'", "an integer"),
    ("hidden_size", [64, 64], "[64, 64]", "an integer"),
    ("hidden_size", {"size": 64}, "{'size': 64}", "an integer"),
    ("num_attention_heads", True, "True", "an integer"),
    ("rotary_base", "ten thousand", "'ten thousand'", "an integer"),
    ("norm_epsilon", [1e-5], "[1e-05]", "a number"),
    ("ffn_hidden_size", ["192"], "['192']", "an integer or null"),
])
def test_a_run_config_value_of_the_wrong_kind_is_one_line(checkpoint, tmp_path, field, value,
                                                          shown, kind):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_model(path, field, value)
    _, message = _refusal(root)
    assert message == f"{file}: model.{field} is {shown}, not {kind}; {FIX}", message


def test_a_run_config_value_out_of_bounds_names_the_field(checkpoint, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_model(path, "ffn_hidden_size", -192)
    assert _refusal(root)[1] == f"{file}: model.ffn_hidden_size must be >= 1, got -192; {FIX}"


def test_trainer_use_checkpoint_args_refuses_a_string_layer_count(checkpoint, demo_data, tmp_path):
    root, path = _copy(checkpoint, tmp_path)
    file = _edit_model(path, "num_layers", "4")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_jreg.train", "--load", root, "--use-checkpoint-args",
         "--data-path", demo_data, "--micro-batch-size", "4", "--global-batch-size", "8",
         "--train-iters", str(ITERATION + 1), "--lr", "1e-3", "--eval-interval", "0"],
        cwd=ROOT, env=env, text=True, capture_output=True, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines[-5:]
    assert lines[0].endswith(f"{file}: model.num_layers is '4', not an integer; {FIX}"), lines[0]


# ---- 5: a tracker that is not ASCII digits, shown escaped --------------------------------------


@pytest.mark.parametrize("raw,shown", [
    ("\u0664".encode("utf-8"), r"'\u0664'"),  # ARABIC-INDIC DIGIT FOUR: int() reads 4
    (b"\x00\xff4", r"b'\x00\xff4'"),  # not UTF-8: the bytes
    ("4\u00b2".encode("utf-8"), r"'4\xb2'"),  # '²'.isdigit(), yet int() refuses it
], ids=["arabic_indic_four", "not_utf8", "superscript_two"])
def test_a_tracker_that_is_not_ascii_digits_is_shown_escaped(checkpoint, tmp_path, raw, shown):
    root, _ = _copy(checkpoint, tmp_path)
    tracker = os.path.join(root, catalog.TRACKER)
    with open(tracker, "wb") as f:
        f.write(raw)
    with pytest.raises(faults.TrackerUnreadable) as err:
        catalog.scan(root).resolve()
    assert str(err.value) == (
        f"{tracker} holds {shown}, not an iteration number; delete it to resume from the "
        "newest whole iteration, or pick one with --ckpt-step")
