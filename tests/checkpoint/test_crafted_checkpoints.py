"""A checkpoint runs no code in the trainer: a crafted pickle in any of its files (made by
tests/crafted_checkpoints.py to run ``touch MARKER`` and then load as the genuine file, with
a matching manifest) is refused in one line naming the file and the import, exit 2, and the
marker is never made: on resume (``--load``: ``.metadata``, ``common.pt``, the random
state's entry in a shard) and on a start from weights (``--pretrained-checkpoint
--use-checkpoint-args``, also from a checkpoint in Megatron-LM's form, whose architecture
comes from ``common.pt``). ``common.pt`` is crafted under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``,
with which megatron-core's own load of it runs code. The restricted unpickler is also tried
on its own against the ways a pickle imports (protocol 0 to 5, dotted names, copyreg
extensions), and a genuine save passes it (the checkpoint tests of every save kind and of
Megatron-LM's checkpoints load through it too). Read from the source, no other reader of
the package unpickles without an allow-list or asks for a model's own code.
"""

import os
import pickle
import re
import shutil

import pytest
import torch
from trainer_runs import REPO, base_args, run_env, train

import crafted_checkpoints as crafted
import forked_trainer
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir

ITERS = 3
FORCE_PICKLE = {
    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}  # megatron-core's common.pt load then runs code


@pytest.fixture(scope="module")
def saved(demo_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted") / "ckpt"
    train(base_args(demo_data, train_iters=ITERS, lr_decay_iters=ITERS, save=root))
    return str(root)


def crafted_copy(saved, tmp_path, kind, megatron_lm_form=False):
    """(checkpoint root, crafted file, marker) of a copy of ``saved`` with ``kind`` crafted."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    path = iteration_dir(str(root), ITERS)
    marker = tmp_path / "MARKER"
    craft = {"metadata": crafted.craft_metadata, "common": crafted.craft_common,
             "rng_state": lambda p, m: crafted.craft_byte_entry(p, "rng_state", m)}[kind]
    file = craft(path, marker)
    if megatron_lm_form:  # only what Megatron-LM writes: the architecture is in common.pt
        for name in ("run_config.yaml", "jreg_manifest.json", "jreg_complete.json"):
            os.remove(os.path.join(path, name))
    return root, file, marker


def refused(proc, marker, file):
    assert not marker.exists(), "the crafted pickle ran its command"
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    # the trainer's own prefix, or argparse's for a flag's value (--use-checkpoint-args)
    assert len(lines) == 1 and re.match(r"(train\.py: )?error: ", lines[0]), proc.stderr[-3000:]
    assert f"{file}: refused to load: unpickling it would import os.system" in lines[0], lines
    assert "could run code" in lines[0] and "rebuild the checkpoint" in lines[0], lines


def run(argv, env_extra=None):
    return forked_trainer.run(argv, REPO, {**run_env(), **(env_extra or {})}, 600)


@pytest.mark.parametrize("kind", ["metadata", "common", "rng_state"])
def test_resume_from_a_crafted_checkpoint_runs_nothing(demo_data, saved, tmp_path, kind):
    root, file, marker = crafted_copy(saved, tmp_path, kind)
    proc = run(base_args(demo_data, train_iters=ITERS + 1, lr_decay_iters=ITERS, load=root),
               FORCE_PICKLE if kind == "common" else None)
    refused(proc, marker, file)


@pytest.mark.parametrize("kind, megatron_lm_form", [("metadata", False), ("common", False),
                                                    ("common", True)])
def test_start_from_crafted_weights_runs_nothing(demo_data, saved, tmp_path, kind,
                                                 megatron_lm_form):
    root, file, marker = crafted_copy(saved, tmp_path, kind, megatron_lm_form)
    proc = run(["--pretrained-checkpoint", str(root), "--use-checkpoint-args",
                "--data-path", demo_data, "--micro-batch-size", "4", "--global-batch-size", "8",
                "--train-iters", "1", "--lr", "1e-3", "--eval-interval", "0"],
               FORCE_PICKLE if kind == "common" else None)
    refused(proc, marker, file)


def test_a_crafted_earlier_versions_rng_file_runs_nothing(tmp_path):
    """rng/rank_NNNNN.pt of an earlier version, read on resume: refused, nothing run."""
    import json
    import random

    import numpy as np

    from crafted_checkpoints import load_rng_files as _load_rng_files
    from megatron_jreg.errors import UserError as CheckpointError

    path = tmp_path / "iter_0000002"
    (path / "rng").mkdir(parents=True)
    (path / "jreg_complete.json").write_text(json.dumps({"iteration": 2, "world_size": 1}))
    rng = path / "rng" / "rank_00000.pt"
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(), "tracker": {}, "device": "cpu"}, rng)
    _load_rng_files(str(path), 0)  # the genuine file loads
    marker = tmp_path / "MARKER"
    rng.write_bytes(crafted.craft_torch_file(rng.read_bytes(), marker))
    with pytest.raises(CheckpointError) as err:
        _load_rng_files(str(path), 0)
    assert not marker.exists()
    assert f"{rng}: refused to load: unpickling it would import os.system" in str(err.value)


# ---- the restricted unpickler of .metadata on its own ---------------------------------------

class _Runs:
    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _read(tmp_path, data):
    from megatron_jreg.checkpoint.safe_pickle import read_metadata

    file = tmp_path / ".metadata"
    file.write_bytes(data)
    with open(file, "rb") as f:
        return read_metadata(f, str(file))


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_of_a_reduce_to_exec_is_refused(tmp_path, protocol):
    from megatron_jreg.checkpoint.faults import UnsafeCheckpoint as UnsafeCheckpointError

    marker = tmp_path / "MARKER"
    payload = pickle.dumps(_Runs(exec, f"open({str(marker)!r}, 'w').close()"), protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match="would import builtins.exec, which "
                       r"dist-checkpointing's index \(.metadata\) never holds"):
        _read(tmp_path, payload)
    assert not marker.exists()


def _global(module, name):
    """A protocol-4 pickle of one STACK_GLOBAL (module, name)."""
    def text(s):
        return b"\x8c" + bytes([len(s)]) + s.encode()
    return b"\x80\x04" + text(module) + text(name) + b"\x93."


@pytest.mark.parametrize("data, name", [
    # a dotted name reaches any attribute of an allowed class, its module's globals included
    (_global("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
     "torch.distributed.checkpoint.metadata.Metadata.__init__.__globals__"),
    # protocol 0's INST imports and calls in one opcode
    (b"(S'true'\nios\nsystem\n.", "os.system"),
    # a torch function that is neither a dtype nor a layout
    (b"ctorch\nload\n.", "torch.load"),
])
def test_other_ways_to_import_are_refused(tmp_path, data, name):
    from megatron_jreg.checkpoint.faults import UnsafeCheckpoint as UnsafeCheckpointError

    with pytest.raises(UnsafeCheckpointError, match=f"would import {name.replace('.', '[.]')},"):
        _read(tmp_path, data)


def test_a_copyreg_extension_code_is_refused(tmp_path):
    """EXT1 looks its code up in copyreg's registry, then imports through find_class."""
    import copyreg

    from megatron_jreg.checkpoint.faults import UnsafeCheckpoint as UnsafeCheckpointError

    copyreg.add_extension("os", "system", 0xF1)
    try:
        with pytest.raises(UnsafeCheckpointError, match="would import os.system,"):
            _read(tmp_path, b"\x80\x02\x82\xf1.")
    finally:
        copyreg.remove_extension("os", "system", 0xF1)


def test_genuine_saves_pass_every_allow_list(saved):
    """The allow-lists hold what our saves write (the checkpoint tests of every save kind
    load through them too: test_checkpoint_formats.py, test_megatron_lm_checkpoints.py)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_jreg.checkpoint import formats, safe_pickle

    path = iteration_dir(saved, ITERS)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = safe_pickle.read_metadata(f, os.path.join(path, ".metadata"))
    assert isinstance(metadata, Metadata)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        assert repr(pickle.load(f).state_dict_metadata) == repr(metadata.state_dict_metadata)
    formats.read(saved, ITERS).opened.check_shards(verify=True)
    assert any(k.startswith("rng_state") for k, _ in safe_pickle._byte_entries(metadata).items())


def test_no_reader_of_the_package_unpickles_or_runs_remote_code():
    """Read from the source: every torch.load of the package and tools passes
    weights_only=True, none calls pickle.load(s) or passes allow_pickle=True, and none asks
    transformers (or lm-eval) for a model's own code (trust_remote_code)."""
    import ast

    found = []
    for top in ("megatron_jreg", "tools"):
        for base, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(base, name)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if not isinstance(node, ast.Call):
                        continue
                    where = f"{os.path.relpath(path, REPO)}:{node.lineno}"
                    call = ast.unparse(node.func)
                    kw = {k.arg: k.value for k in node.keywords}

                    def const(key, default=None, kw=kw):
                        value = kw.get(key)
                        return value.value if isinstance(value, ast.Constant) else default

                    if call == "torch.load" and const("weights_only") is not True:
                        found.append(f"{where}: torch.load without weights_only=True")
                    if call in ("pickle.load", "pickle.loads"):
                        found.append(f"{where}: {call}")
                    if "allow_pickle" in kw and const("allow_pickle", True) is not False:
                        found.append(f"{where}: allow_pickle")
                    if "trust_remote_code" in kw and const("trust_remote_code", True) is not False:
                        found.append(f"{where}: trust_remote_code")
    assert not found, found
