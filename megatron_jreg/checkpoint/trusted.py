"""The one trusted open of an iteration directory, and the only reader of its files.

:func:`open_iteration` checks, before anything is unpickled, that every entry is a regular
file or directory inside it, reads ``.metadata`` and ``common.pt`` once into memory, checks
them against the manifest and unpickles them under allow-lists (safe_pickle.py). The handle
(:class:`Opened`) serves the common state, the metadata and megatron-core's load over them.
This module alone imports dist-checkpointing's and torch DCP's readers.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import os
import pathlib
import stat
import sys
import types
import zlib
from typing import Dict, Optional, Set

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

from megatron_jreg.checkpoint import index_shape, manifest, safe_pickle
from megatron_jreg.checkpoint.catalog import Ref
from megatron_jreg.checkpoint.faults import DamagedFile, UnknownVersion, UnsafeCheckpoint
from megatron_jreg.checkpoint.files import inside, kind_of, open_regular
from megatron_jreg.checkpoint.notes import report_once

METADATA_FILE, COMMON_FILE = ".metadata", "common.pt"
def check_tree(directory: str) -> Set[str]:
    """The relative names of ``directory``'s files, each a regular file or a link to one
    inside it; raises UnsafeCheckpoint for anything else."""
    found, stack = set(), [directory]
    while stack:
        here = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    if not inside(entry.path, directory):
                        raise UnsafeCheckpoint(entry.path, f"it is a link out of {directory}")
                    try:
                        mode = os.stat(entry.path).st_mode
                    except OSError:
                        raise UnsafeCheckpoint(entry.path, "it is a broken link") from None
                    if stat.S_ISDIR(mode):
                        raise UnsafeCheckpoint(entry.path, "it is a link to a directory")
                if stat.S_ISDIR(mode):
                    stack.append(entry.path)
                elif stat.S_ISREG(mode):
                    found.add(os.path.relpath(entry.path, directory))
                else:
                    raise UnsafeCheckpoint(entry.path, f"it is {kind_of(mode)}, not a regular file")
    return found


class _ConfinedFileSystem(FileSystem):
    """torch DCP's file system, opening only regular files inside the iteration."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise UnsafeCheckpoint(str(path), "a load asked to write it")
        with open_regular(str(path), self.directory) as stream:
            yield stream


class _CheckedReader(FileSystemReader):
    """torch DCP's reader over the metadata already read and checked."""

    def __init__(self, directory: str, metadata):
        super().__init__(directory)
        self.fs = _ConfinedFileSystem(directory)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self._metadata


def _common_from_memory(common: Dict):
    """megatron-core's common strategy, answering with the common state already read."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonFromMemory(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return copy.deepcopy(common)

    return CommonFromMemory()


class Opened:
    """An iteration directory checked by :func:`open_iteration`."""

    def __init__(self, ref: Ref, files: Set[str], metadata, common: Dict, entries: Dict):
        self.ref, self.path, self.files = ref, ref.path, files
        self.metadata, self.common = metadata, common
        self._entries = entries  # the manifest's entries (empty: none, or not verified)
        self._shards_checked = False

    def require_metadata(self) -> None:
        if self.metadata is None:
            raise DamagedFile(path=self.path, checksum=False,
                              detail=f"{self.path} holds no {METADATA_FILE}")

    @contextlib.contextmanager
    def _reading(self):
        """megatron-core's torch strategy reading through :class:`_CheckedReader`."""
        from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

        original = mcore_torch._get_filesystem_reader
        mcore_torch._get_filesystem_reader = lambda d, cache_metadata=False: _CheckedReader(
            self.path, copy.deepcopy(self.metadata))
        try:
            yield
        finally:
            mcore_torch._get_filesystem_reader = original

    def entries(self) -> Dict[str, Optional[tuple]]:
        """{key: global shape} of each saved tensor, {unique key: None} of each sharded
        object (megatron-core's keys: ``KEY/shard_OFFSET_SHAPE``)."""
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        return {k: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
                for k, v in saved.items()}

    def content_metadata(self) -> Dict:
        return dict(self.common.get("content_metadata") or {})

    def read_text(self, name: str, limit: Optional[int] = None) -> Optional[str]:
        """File ``name`` as text (None: no such file); with ``limit``, at most ``limit`` + 1
        bytes of it (the reader refuses one over its bound without reading it all)."""
        if name not in self.files:
            return None
        with open_regular(os.path.join(self.path, name), self.path) as f:
            data = f.read() if limit is None else f.read(limit + 1)
        return data.decode("utf-8", errors="replace")

    def read_torch(self, name: str, what: str):
        """A torch file of the directory (an earlier version's random state), read as data."""
        file = os.path.join(self.path, name)
        with open_regular(file, self.path) as f:
            data = f.read()
        return safe_pickle.load_torch_file(io.BytesIO(data), file, what)

    def check_shards(self, verify: bool) -> None:
        """Collective: the shards' checksums (``verify``) and every pickled entry in them."""
        self.require_metadata()
        if self._shards_checked:
            return
        if verify and self._entries:
            problem = manifest.verify_files(self.path, self._entries,
                                            skip=(METADATA_FILE, COMMON_FILE), opener=open_regular)
            if problem:
                raise DamagedFile(path=self.path, checksum=True, detail=problem)
        safe_pickle.check_byte_entries(self.path, self.metadata,
                                       lambda f: open_regular(f, self.path))
        self._shards_checked = True

    def load(self, state: Dict, fully_parallel_group=None) -> Dict:
        """megatron-core's load of ``state`` from this directory (collective); with
        ``fully_parallel_group``, each tensor several data-parallel ranks need is read by
        one of them and sent to the others."""
        from megatron.core.dist_checkpointing import load as mcore_load
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        with self._reading():
            strategy = get_default_load_sharded_strategy(self.path)
            if fully_parallel_group is not None:
                strategy = FullyParallelLoadStrategyWrapper(strategy, fully_parallel_group)
            return mcore_load(state, self.path, strategy, _common_from_memory(self.common))


def _read_checked(path: str, name: str, entries: Dict) -> Optional[bytes]:
    """File ``name`` of ``path`` read once, compared with its manifest entry; None when
    the directory has no such file."""
    file = os.path.join(path, name)
    if not os.path.lexists(file):
        return None
    with open_regular(file, path) as f:
        data = f.read()
    entry = entries.get(name)
    why = entry and manifest.mismatch(file, len(data), zlib.crc32(data), entry)
    if why:
        raise DamagedFile(path=path, checksum=True, detail=why)
    return data


def _read_common(file: str, data: bytes) -> Dict:
    """The common state from ``data``: our args are a SimpleNamespace of plain values;
    Megatron-LM's hold argparse's Namespace and megatron-core's enums, which megatron-core's
    allow-list (registered at its import, done here) admits."""
    torch.serialization.add_safe_globals([types.SimpleNamespace, pathlib.PosixPath])
    what = "megatron-core's common state (common.pt)"
    try:
        try:
            state = safe_pickle.load_torch_file(io.BytesIO(data), file, what)
        except UnsafeCheckpoint:
            if "megatron.core" in sys.modules:
                raise
            importlib.import_module("megatron.core")  # registers its allow-list
            state = safe_pickle.load_torch_file(io.BytesIO(data), file, what)
    except UnsafeCheckpoint:
        raise
    except Exception as err:
        raise safe_pickle.damaged(file, err) from None
    if not isinstance(state, dict):
        raise DamagedFile(path=os.path.dirname(file), checksum=False,
                          detail=f"{file} holds a {type(state).__name__}, not a state dict")
    _check_version(file, state)
    return state


# Megatron-LM's common-state versions of the layout read here: 3.0, what its torch_dist
# saves carry (megatron/training/checkpointing.py, core_v0.16.1) and so ours; before 3.0 its
# saves were the legacy torch format, with other argument names and QKV layouts
KNOWN_VERSIONS = (3.0,)


def _check_version(file: str, state: Dict) -> None:
    """A ``checkpoint_version`` in the common state is one of :data:`KNOWN_VERSIONS` (a
    state without one: this project's earlier saves and HF imports)."""
    if "checkpoint_version" not in state:
        return
    version = state["checkpoint_version"]
    if isinstance(version, bool) or not isinstance(version, (int, float)) \
            or version not in KNOWN_VERSIONS:
        raise UnknownVersion(file=file, version=version, known=KNOWN_VERSIONS)


def _check_storage_names(path: str, metadata, files: Set[str]) -> None:
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or os.path.isabs(name) or os.sep in name or name in (".", ".."):
            raise UnsafeCheckpoint(os.path.join(path, METADATA_FILE),
                                   f"it names the storage file {name!r}, outside the directory")
        if name not in files:
            raise DamagedFile(path=path, checksum=False,
                              detail=f"{os.path.join(path, name)} is missing")


def open_iteration(ref: Ref, verify: bool = True) -> Opened:
    """Check and open iteration ``ref`` (catalog.py); not collective."""
    path = ref.path
    files = check_tree(path)
    entries = manifest.read_entries(path) if verify else {}
    # a missing file is named where it is needed (formats.py, the load), after what the
    # directory holds is described
    meta_bytes = _read_checked(path, METADATA_FILE, entries)
    metadata = None
    if meta_bytes is not None:
        meta_file = os.path.join(path, METADATA_FILE)
        metadata = safe_pickle.read_metadata(io.BytesIO(meta_bytes), meta_file)
        index_shape.check_index(metadata, meta_file)  # its root and fields as DCP reads them
        _check_storage_names(path, metadata, files)
    common_bytes = _read_checked(path, COMMON_FILE, entries)
    common = {} if common_bytes is None else _read_common(os.path.join(path, COMMON_FILE),
                                                          common_bytes)
    if ref.note:
        report_once(ref.note)
    return Opened(ref, files, metadata, common, entries)
