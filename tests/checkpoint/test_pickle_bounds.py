"""The pickles of a checkpoint are bounded as well as allow-listed (safe_pickle.py,
trusted.py): a BUILD opcode in ``.metadata`` may fill in an instance of an allow-listed
class, never set attributes of the class itself or of a shared object (an enum member),
which would change it for the whole process; a memo index past what the file's bytes can
hold is refused before any memory is taken for it (Python's C unpickler allocates a memo as
long as the index: 16 GB for the 9 bytes of ``LONG_BINPUT 2**30``); torch's weights_only
reader of ``common.pt`` keeps its memo in a dict (no allocation to refuse); and a
``checkpoint_version`` other than Megatron-LM's 3.0 is named in one line.

Each attack runs in a child process (a regression mutates the child's classes, not the test
process's) under an address-space cap (a regression fails instead of taking the machine)."""

import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import megatron_jreg
from megatron_jreg.checkpoint import catalog, faults, formats, safe_pickle, trusted

# the checkout whose package this test imports (children import the same one)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(megatron_jreg.__file__)))
CAP = 3 << 30  # bytes of address space for a child (torch's import takes about 1 GB)

# GLOBAL MetadataIndex; BUILD with state (None, {'__hash__': None}): setattr on the class
BUILD_ON_CLASS = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
                  b"N}X\x08\x00\x00\x00__hash__Ns\x86b.")
# WriteItemType(1) (an enum member, shared by the process); BUILD setting its _value_
BUILD_ON_ENUM = (b"\x80\x02ctorch.distributed.checkpoint.planner\nWriteItemType\nK\x01\x85R"
                 b"N}X\x07\x00\x00\x00_value_K\x07s\x86b.")
# NONE, LONG_BINPUT 2**30, STOP: 9 bytes asking for a memo of 2**30 slots
MEMO_BOMB = b"\x80\x02Nr" + struct.pack("<I", 2 ** 30) + b"."

CHILD = r"""
import io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType
from megatron_jreg.checkpoint import safe_pickle
hash_before, value_before = MetadataIndex.__hash__, WriteItemType.TENSOR._value_
outcomes = []
for data in sys.argv[1:]:
    try:
        safe_pickle.read_metadata(io.BytesIO(bytes.fromhex(data)), "it/.metadata")
        outcome = {{"error": None}}
    except BaseException as err:
        outcome = {{"error": type(err).__name__, "line": str(err)}}
    outcome["hash_intact"] = MetadataIndex.__hash__ is hash_before
    outcome["enum_intact"] = WriteItemType.TENSOR._value_ == value_before
    outcomes.append(outcome)
print(json.dumps(outcomes))
"""
ATTACKS = (BUILD_ON_CLASS, BUILD_ON_ENUM, MEMO_BOMB)


@pytest.fixture(scope="module")
def outcomes():
    """Each attack read in one child process (one import of torch for all three)."""
    proc = subprocess.run([sys.executable, "-c", CHILD.format(cap=CAP)]
                          + [data.hex() for data in ATTACKS],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(ATTACKS, json.loads(proc.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("data,what", [
    (BUILD_ON_CLASS, "the class torch.distributed.checkpoint.metadata.MetadataIndex"),
    (BUILD_ON_ENUM, "a shared WriteItemType object"),
], ids=["class", "enum_member"])
def test_build_on_a_class_or_shared_object_is_refused(outcomes, data, what):
    outcome = outcomes[data]
    assert outcome["hash_intact"] and outcome["enum_intact"], outcome
    assert outcome["error"] == "UnsafeCheckpoint", outcome
    line = outcome["line"]
    assert "\n" not in line and line.startswith("it/.metadata: refused to load: "), line
    assert f"set attributes of {what} for the whole process" in line, line


def test_a_memo_index_past_the_file_is_refused_without_memory(outcomes):
    outcome = outcomes[MEMO_BOMB]
    assert outcome["error"] == "UnsafeCheckpoint", outcome
    line = outcome["line"]
    assert "\n" not in line and f"memo index {2 ** 30}, past what its 9 bytes can hold" in line


def _metadata_of_every_kind():
    """A dist-checkpointing index holding each allow-listed class, as torch writes it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    size = torch.Size([4, 8])
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), size)
    props = TensorProperties(dtype=torch.bfloat16, layout=torch.strided)
    index = MetadataIndex("w", torch.Size([0, 0]))
    return Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(props, size, [chunk]),
                             "rng/shard_0_1": BytesStorageMetadata()},
        planner_data={"w": ("w",)},
        storage_data={index: _StorageInfo("__0_0.distcp", 0, 64),
                      MetadataIndex("rng/shard_0_1"): _StorageInfo("__0_0.distcp", 64, 32)},
        storage_meta=StorageMeta(),
    ), SavePlan([WriteItem(index, WriteItemType.TENSOR)])


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_an_index_reads_as_pickle_reads_it(protocol):
    """BUILD on instances of the allow-listed classes stays: what pickle.load gives."""
    for obj in _metadata_of_every_kind():
        data = pickle.dumps(obj, protocol=protocol)
        assert safe_pickle.read_metadata(io.BytesIO(data), "x/.metadata") == pickle.loads(data)


def _torch_zip_with(tmp_path, pickled: bytes) -> bytes:
    """A torch.save zip of an empty dict whose data.pkl is ``pickled``."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    source, out = zipfile.ZipFile(io.BytesIO(buffer.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info.filename, pickled if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()


def test_common_state_memo_takes_no_memory(tmp_path):
    """torch's weights_only reader (common.pt, rng files, sharded objects) keeps its memo in a
    dict: a LONG_BINPUT 2**30 in common.pt reads in a child capped far below 16 GB."""
    data = _torch_zip_with(tmp_path, b"\x80\x02}r" + struct.pack("<I", 2 ** 30) + b".")
    child = ("import io, resource, sys\n"
             f"resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))\n"
             "from megatron_jreg.checkpoint import trusted\n"
             "print(trusted._read_common('it/common.pt', open(sys.argv[1], 'rb').read()))\n")
    (tmp_path / "common.pt").write_bytes(data)
    proc = subprocess.run([sys.executable, "-c", child, str(tmp_path / "common.pt")],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "{}", proc.stderr[-2000:]


def _iteration(tmp_path, common: dict, metadata: bytes = None) -> str:
    """A whole Megatron-LM-shaped iteration 1 of ``tmp_path/ckpt`` (no shards: nothing is
    loaded) with ``common`` as its common state."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = tmp_path / "ckpt" / "iter_0000001"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(metadata or pickle.dumps(Metadata(state_dict_metadata={})))
    torch.save(common, path / "common.pt")
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "ckpt" / catalog.TRACKER).write_text("1")
    return str(tmp_path / "ckpt")


def test_a_memo_index_past_the_file_is_refused_by_the_open(tmp_path):
    """Through the trusted open, in this process: an index of 1000 in 9 bytes (harmless here
    whatever the reader; the bomb itself is read in the capped child above)."""
    small = b"\x80\x02Nr" + struct.pack("<I", 1000) + b"."
    root = _iteration(tmp_path, {}, metadata=small)
    with pytest.raises(faults.UnsafeCheckpoint,
                       match="memo index 1000, past what its 9 bytes") as err:
        formats.read(root)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("version", [99, "3.0", math.nan, 2.0, None, True])
def test_an_unknown_checkpoint_version_is_named(tmp_path, version):
    root = _iteration(tmp_path, {"args": None, "checkpoint_version": version})
    with pytest.raises(faults.UnknownVersion) as err:
        formats.read(root)
    line = faults.phrase(err.value, faults.TOOLS)
    assert "\n" not in line and line.startswith(os.path.join(root, "iter_0000001", "common.pt"))
    said = "NaN" if isinstance(version, float) and math.isnan(version) else repr(version)
    assert f"checkpoint_version is {said}" in line and "of version 3.0" in line, line


def test_megatron_lm_version_opens(tmp_path):
    """3.0 (Megatron-LM's and ours) and no version (earlier saves of ours) open."""
    for n, common in enumerate(({"checkpoint_version": 3.0}, {"checkpoint_version": 3}, {})):
        root = _iteration(tmp_path / str(n), common)
        opened = trusted.open_iteration(catalog.scan(root).resolve())
        assert opened.common == common
