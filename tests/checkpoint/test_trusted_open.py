"""The trusted open (megatron_jreg/checkpoint/trusted.py) refuses, before anything is
unpickled or waited on: a FIFO (with and without a writer feeding it a pickle that runs a
command), a device or a link out of the directory in place of ``.metadata``, ``common.pt`` or
a shard; and storage names in ``.metadata`` that leave the directory (``..``, an absolute
path to another run's shard), with the manifest rewritten to match, as an attacker would.
Each in the library and in every command that reads a checkpoint: one line, exit 2, nothing
run, nothing written."""

import json
import os
import pickle
import shutil
import stat
import threading
import zlib

import pytest
from checkpoint_runs import ITERS, REPO, run_env

import forked_trainer
from megatron_jreg.checkpoint import formats, safe_pickle
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir
from megatron_jreg.checkpoint.faults import UnsafeCheckpoint

PAYLOAD = b"cos\nsystem\n(S'touch %s'\ntR."  # a pickle that runs `touch MARKER`


def _copy(checkpoint, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    return root, iteration_dir(str(root), ITERS)


def _shard(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]


class Feeder:
    """A writer feeding ``PAYLOAD`` into FIFO ``path`` whenever a reader opens it."""

    def __init__(self, path, marker):
        self.path, self.data = path, PAYLOAD % str(marker).encode()
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def _feed(self):
        try:
            with open(self.path, "wb") as f:  # blocks until a reader opens the FIFO
                f.write(self.data)
        except OSError:
            pass

    def stop(self):
        try:  # release a writer still waiting for a reader
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
        self.thread.join(5)


def _fifo(path, name):
    os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))
    return os.path.join(path, name)


def _link(path, name, target):
    os.remove(os.path.join(path, name))
    os.symlink(target, os.path.join(path, name))
    return os.path.join(path, name)


def _rewrite_metadata(path, rename):
    """``.metadata`` with each storage record's file name passed through ``rename``, and the
    manifest's entry for it updated to the new bytes (what an attacker would also do)."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        metadata = safe_pickle.read_metadata(f, file)
    for info in metadata.storage_data.values():
        info.relative_path = rename(info.relative_path)
    data = pickle.dumps(metadata)
    with open(file, "wb") as f:
        f.write(data)
    manifest = os.path.join(path, "jreg_manifest.json")
    entries = json.load(open(manifest))
    entries["files"][".metadata"] = {"size": len(data), "crc32": zlib.crc32(data)}
    json.dump(entries, open(manifest, "w"))
    return file


def _attack(kind, path, tmp_path, other):
    """Apply attack ``kind`` to iteration directory ``path``; returns (file named, feeder)."""
    marker = tmp_path / "MARKER"
    if kind.startswith("fifo"):
        name = {"fifo_metadata": ".metadata", "fifo_common": "common.pt",
                "fifo_shard": _shard(path)}[kind.replace("_fed", "")]
        file = _fifo(path, name)
        return file, (Feeder(file, marker) if kind.endswith("_fed") else None)
    if kind == "link_to_fifo":
        fifo = str(tmp_path / "outside.fifo")
        os.mkfifo(fifo)
        return _link(path, ".metadata", fifo), None
    if kind == "link_to_device":
        return _link(path, "common.pt", "/dev/zero"), None
    if kind == "link_out":  # another run's shard, bytes and all
        name = _shard(path)
        return _link(path, name, os.path.join(iteration_dir(str(other), ITERS), name)), None
    if kind == "storage_dotdot":
        other_it = os.path.relpath(iteration_dir(str(other), ITERS), path)
        return _rewrite_metadata(path, lambda n: os.path.join(other_it, n)), None
    if kind == "storage_absolute":
        other_it = iteration_dir(str(other), ITERS)
        return _rewrite_metadata(path, lambda n: os.path.join(other_it, n)), None
    raise AssertionError(kind)


KINDS = ["fifo_metadata", "fifo_metadata_fed", "fifo_common", "fifo_common_fed", "fifo_shard",
         "fifo_shard_fed", "link_to_fifo", "link_to_device", "link_out", "storage_dotdot",
         "storage_absolute"]


@pytest.fixture
def other(checkpoint, tmp_path):
    """A second, genuine run whose files an attack points at."""
    root = tmp_path / "other"
    shutil.copytree(checkpoint, root)
    return root


@pytest.mark.parametrize("kind", KINDS)
def test_the_open_refuses_before_reading(checkpoint, other, tmp_path, kind):
    root, path = _copy(checkpoint, tmp_path)
    file, feeder = _attack(kind, path, tmp_path, other)
    outcome = {}

    def read():
        try:
            source = formats.read(str(root))
            source.opened.check_shards(verify=True)  # what a load reads next
            outcome["read"] = source
        except BaseException as err:  # noqa: BLE001 - judged below
            outcome["error"] = err

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(30)
    if feeder is not None:
        feeder.stop()
    assert not thread.is_alive(), "the open waited on a FIFO"
    err = outcome.get("error")
    assert isinstance(err, UnsafeCheckpoint), outcome
    assert str(err).startswith(f"{file}: refused to load: "), str(err)
    assert "rebuild the checkpoint" in str(err)
    assert not (tmp_path / "MARKER").exists()


def test_a_genuine_copy_opens(checkpoint, tmp_path):
    """The control: the same copy, untouched, opens and describes itself."""
    root, path = _copy(checkpoint, tmp_path)
    source = formats.read(str(root))
    source.opened.check_shards(verify=True)
    assert source.iteration == ITERS and source.path == path
    assert source.format.kind == formats.OURS and source.format.embedding_rows >= 256
    assert source.format.train_state["consumed_samples"] > 0


def _run(tmp_path, command, root, checkpoint):
    """``command`` reading ``root`` as its documented flags have it."""
    env = dict(run_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO,
               HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    if command == "train":
        data = os.path.join(os.path.dirname(str(checkpoint)), "demo_text_document")
        argv = ["--load", root, "--model-preset", "tiny", "--seq-length", 64, "--vocab-size", 512,
                "--data-path", data, "--tokenizer-type", "ByteTokenizer", "--micro-batch-size", 4,
                "--global-batch-size", 8, "--train-iters", ITERS + 1, "--eval-interval", 0,
                "--save", tmp_path / "saves"]
        return forked_trainer.run([str(a) for a in argv], REPO, env, 600)
    text = tmp_path / "eval.txt"
    text.write_text("the jump of the last layer\nresidual state of a token norm\n")
    if command == "eval_jump":
        argv = ["--load", root, "--text-file", text, "--json", tmp_path / "out.json",
                "--no-progress"]
    elif command == "convert_to_hf":
        argv = ["--load", root, "--output", tmp_path / "hf"]
    else:
        pytest.importorskip("lm_eval")
        from downstream_tasks import LAMBADA, write_tasks

        argv = ["--load", root, "--tasks", LAMBADA, "--include-path",
                write_tasks(str(tmp_path / "tasks")), "--no-cache", "--json", tmp_path / "down"]
    return forked_trainer.run_tool(f"tools/{command}.py", [str(a) for a in argv], env, timeout=600)


@pytest.mark.parametrize("kind", ["fifo_metadata_fed", "link_to_fifo", "storage_dotdot"])
@pytest.mark.parametrize("command", ["train", "eval_jump", "convert_to_hf", "eval_downstream"])
def test_every_command_refuses_in_one_line(checkpoint, other, tmp_path, kind, command):
    root, path = _copy(checkpoint, tmp_path)
    file, feeder = _attack(kind, path, tmp_path, other)
    try:
        proc = _run(tmp_path, command, root, checkpoint)
    finally:
        if feeder is not None:
            feeder.stop()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{file}: refused to load: " in last, proc.stderr[-3000:]
    assert not (tmp_path / "MARKER").exists()
    for output in ("out.json", "hf", "down", "saves"):
        assert not (tmp_path / output).exists()
    assert os.path.basename(file) in os.listdir(path)  # nothing of the checkpoint removed
    assert stat.S_ISDIR(os.stat(path).st_mode)


# the readers of a checkpoint's files that megatron-core and torch DCP offer
READERS = {"load", "load_common_state_dict", "load_sharded_metadata", "load_tensors_metadata",
           "load_content_metadata", "load_plain_tensors", "get_default_load_sharded_strategy",
           "FileSystemReader", "CachedMetadataFileSystemReader", "TorchCommonLoadStrategy",
           "FullyParallelLoadStrategyWrapper", "TorchDistLoadShardedStrategy", "load_state_dict",
           "read_metadata"}
READER_MODULES = ("megatron.core.dist_checkpointing", "torch.distributed.checkpoint")


def _reader_uses(source: str):
    """(line, what) of each import of a reader from those modules, and each
    ``dist_checkpointing.<reader>`` attribute use, in Python ``source``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(READER_MODULES):
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if a.name in READERS or a.name in ("torch", "dist_checkpointing")]
        elif isinstance(node, ast.Attribute) and node.attr in READERS and \
                isinstance(node.value, ast.Name) and node.value.id in ("dist_checkpointing", "dcp"):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_only_the_trusted_open_imports_a_checkpoint_reader():
    """Read from the source: megatron-core's and torch DCP's readers are imported by
    checkpoint/trusted.py alone (safe_pickle.py reads the allow-listed entries with DCP's
    file view, no reader)."""
    package = os.path.join(REPO, "megatron_jreg")
    offenders = []
    for base, _, files in os.walk(package):
        for name in files:
            path = os.path.join(base, name)
            if not name.endswith(".py") or path.endswith(os.path.join("checkpoint", "trusted.py")):
                continue
            for line, what in _reader_uses(open(path).read()):
                offenders.append(f"{os.path.relpath(path, REPO)}:{line}: {what}")
    assert offenders == []


def test_the_reader_scan_finds_one():
    planted = ("from megatron.core.dist_checkpointing import load_common_state_dict\n"
               "from megatron.core import dist_checkpointing\n"
               "x = dist_checkpointing.load(1, 2)\n"
               "from torch.distributed.checkpoint import FileSystemReader\n")
    assert sorted(w for _, w in _reader_uses(planted)) == [
        "dist_checkpointing.load", "megatron.core.dist_checkpointing.load_common_state_dict",
        "torch.distributed.checkpoint.FileSystemReader"]
