"""The pickles of a checkpoint are read as data, never as code.

A torch_dist iteration holds four kinds of pickle (``.metadata``, the byte entries inside
the ``.distcp`` shards, ``common.pt``, earlier versions' ``rng/rank_NNNNN.pt``), and the
libraries that read them would run whatever a crafted one names. :func:`read_metadata` (an
unpickler that imports only :data:`METADATA_GLOBALS`), :func:`load_torch_file` and
:func:`check_byte_entries` (``torch.load(weights_only=True)``) read them first, as the
trusted open (trusted.py) hands them over; a file naming anything else is refused
(``faults.UnsafeCheckpoint``) and nothing in it runs.
"""

from __future__ import annotations

import _compat_pickle
import enum
import importlib
import io
import os
import pickle
import re
import struct
from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch

from megatron_jreg.checkpoint.faults import DamagedFile, UnsafeCheckpoint

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"

# What torch_dist's .metadata is made of: torch.distributed.checkpoint's dataclasses and
# enums (the index, the storage records, the save plans megatron-core keeps in it), torch's
# Size, and torch's dtypes and layouts (:func:`_allowed_in_metadata`). Each is data: built
# without running anything but its own constructor or enum lookup.
METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout pickles as this call on its name
    ("collections", "OrderedDict"),
})


def _allowed_in_metadata(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS:
        return True
    # a dtype or layout pickles as the attribute of torch that holds it (torch.float32);
    # vars(), not getattr(): torch's module __getattr__ imports submodules on a miss
    return module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.layout))


class _Refused(pickle.UnpicklingError):
    """What a .metadata would do that it never does: ``name`` the import, or ``reason``."""

    def __init__(self, name: str, reason: Optional[str] = None):
        super().__init__(reason or name)
        self.name, self.reason = name, reason


def _buildable() -> frozenset:
    """The classes whose instances a .metadata's BUILD may fill in: the allow-listed
    dataclasses (and OrderedDict), never a class itself, an enum member or a dtype, which
    are shared by the whole process."""
    classes = set()
    for module, name in METADATA_GLOBALS:
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and not issubclass(found, (enum.Enum, tuple)):
            classes.add(found)
    return frozenset(classes)


class _MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the only one with a dispatch table
    """Python's own unpickler (``pickle._Unpickler``, the reference the C one mirrors),
    importing only what a dist-checkpointing index holds. Every import of a pickle goes
    through ``find_class`` (GLOBAL, STACK_GLOBAL, INST, OBJ and the copyreg extension
    codes); a REDUCE or NEWOBJ can only call what it returned. Python's unpickler, not the
    C one, because two opcodes need judging before they act:

    - BUILD sets attributes of the object under it: only of an instance of
      :func:`_buildable`'s classes (``MetadataIndex.__hash__ = None`` on the class itself
      would change it for the whole process);
    - a memo index (PUT, BINPUT, LONG_BINPUT) is at most the file's size (a pickle holds
      fewer objects than bytes); the C unpickler allocates a memo as long as the index,
      16 GB for the 9 bytes of ``LONG_BINPUT 2**30``.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001

    def __init__(self, stream, size: int):
        super().__init__(stream)
        self._size = size
        self._buildable = _buildable()

    def find_class(self, module: str, name: str):
        # protocols 0-2 name Python 2's modules, which pickle maps to Python 3's: judge
        # (and name) what it would import
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if _allowed_in_metadata(module, name):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):  # torch's .metadata has none
        raise pickle.UnpicklingError("a persistent id, which a .metadata never holds")

    def load_build(self):
        target = self.stack[-2]  # under the state
        if type(target) not in self._buildable:
            what = (f"the class {target.__module__}.{target.__qualname__}"
                    if isinstance(target, type) else f"a shared {type(target).__name__} object")
            raise _Refused(what, f"unpickling it would set attributes of {what} for the whole "
                                 "process (a BUILD opcode), which a .metadata never does")
        super().load_build()

    def _memo_index(self, index: int) -> None:
        if index > self._size:
            raise _Refused(str(index), f"it puts an object at memo index {index}, past what "
                                       f"its {self._size} bytes can hold (a pickle that would "
                                       "take memory for that many objects)")
        self.memo[index] = self.stack[-1]

    def load_put(self):
        self._memo_index(int(self.readline()[:-1]))

    def load_binput(self):
        self._memo_index(self.read(1)[0])

    def load_long_binput(self):
        self._memo_index(struct.unpack("<I", self.read(4))[0])

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.PUT[0]] = load_put
    dispatch[pickle.BINPUT[0]] = load_binput
    dispatch[pickle.LONG_BINPUT[0]] = load_long_binput


def refusal(file: str, name: str, what: str) -> UnsafeCheckpoint:
    """The one-line refusal of ``file`` (``what``: the kind of file, as "which WHAT never
    holds" reads) for importing ``name``."""
    return UnsafeCheckpoint(file, f"unpickling it would import {name}, which {what} never "
                                  "holds, and could run code")


def damaged(file: str, err: Union[BaseException, str], entry: Optional[str] = None) -> DamagedFile:
    """The one-line fault of ``file`` (its byte entry ``entry``, where one of a shard) that
    does not read as what dist-checkpointing writes: ``err``, the reader's error or what
    is wrong with what it read."""
    if isinstance(err, str):
        why = err
    else:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        why = f"{type(err).__name__}: {first}" if first else type(err).__name__
    what = f"entry {entry} of checkpoint file {file}" if entry else f"checkpoint file {file}"
    return DamagedFile(path=os.path.dirname(file), checksum=False, foreign=True,
                       detail=f"cannot read {what} ({why})")


def _remaining(stream) -> int:
    here = stream.tell()
    end = stream.seek(0, os.SEEK_END)
    stream.seek(here)
    return end - here


def read_metadata(stream, file: str):
    """dist-checkpointing's ``Metadata`` from ``stream`` (the bytes of ``file``, a
    ``.metadata``), read with only :data:`METADATA_GLOBALS` importable, BUILD only on
    their instances and memo indices bounded by the file's size (:class:`_MetadataUnpickler`)."""
    try:
        return _MetadataUnpickler(stream, _remaining(stream)).load()
    except _Refused as err:
        if err.reason:
            raise UnsafeCheckpoint(file, err.reason) from None
        raise refusal(file, err.name, "dist-checkpointing's index (.metadata)") from None
    except Exception as err:  # a truncated or foreign file; RecursionError included
        raise damaged(file, err) from None


def torch_file_globals() -> list:
    """The numpy classes above, looked up when a file is read (numpy 2 names its core
    ``numpy._core``, numpy 1 ``numpy.core``; nothing of numpy's runs at import)."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]
# torch names the import it refused as "GLOBAL module.name" (in two wordings)
_GLOBAL_NAME = re.compile(r"GLOBAL ([\w.]+)")


def _weights_only_reason(text: str) -> str:
    """The specific line of torch's weights_only error (between its fixed header and its
    pointer to the documentation)."""
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    middle = parts[1:-1] or parts[-1:] or ["unpickling failed"]
    return middle[0].splitlines()[0].replace("WeightsUnpickler error: ", "")[:200]


def load_torch_file(source, file: str, what: str):
    """``torch.load(source, weights_only=True)`` with :func:`torch_file_globals` allowed
    (added for good, as megatron-core adds its own: a ``safe_globals`` block would take
    megatron-core's away again at its end). A refusal raises ``UnsafeCheckpoint``
    naming ``file`` (``what``: as :func:`refusal`); a damaged file, torch's own error."""
    torch.serialization.add_safe_globals(torch_file_globals())
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(str(err))
        found = _GLOBAL_NAME.search(reason)
        if found:
            raise refusal(file, found.group(1), what) from None
        raise UnsafeCheckpoint(file, f"unpickling it would do what {what} never does "
                                     f"({reason}), and could run code") from None


def _byte_entries(metadata) -> Dict[str, Tuple[str, object]]:
    """{key: (shard file name, storage record)} of the byte entries ``metadata`` lists."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    entries = {}
    storage = getattr(metadata, "storage_data", None) or {}
    for key, kind in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        if isinstance(kind, BytesStorageMetadata):
            info = storage.get(MetadataIndex(key))
            if info is not None:
                entries[key] = (str(info.relative_path), info)
    return entries


def check_byte_entries(path: str, metadata, open_shard) -> None:
    """Each byte entry that ``metadata`` (iteration directory ``path``'s index) lists in its
    shards (the sharded objects dist-checkpointing's load unpickles), cut from its file as
    torch's reader cuts it and read with :func:`load_torch_file`. ``open_shard(file)``
    opens a shard (trusted.open_regular)."""
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.utils import _create_file_view

    by_file: Dict[str, list] = {}
    for key, (name, info) in _byte_entries(metadata).items():
        by_file.setdefault(name, []).append((key, info))
    transforms = _StorageReaderTransforms()
    for name, items in sorted(by_file.items()):
        shard = os.path.join(path, name)
        with open_shard(shard) as stream:
            for key, info in items:
                where = f"{shard} (entry {key})"
                try:
                    view = _create_file_view(stream, info.offset, info.length)
                    data = transforms.transform_load_stream(
                        None, info.transform_descriptors or (), view).read(-1)
                    load_torch_file(io.BytesIO(data), where, "a checkpoint's sharded object")
                except UnsafeCheckpoint:
                    raise
                except Exception as err:
                    raise damaged(shard, err, entry=key) from None
