"""Checkpoint files crafted as an attacker would: each still holds its genuine content, and
unpickling it first runs ``touch MARKER`` (``os.system``), so a reader that runs code loads
the checkpoint as if nothing happened. The manifest is rewritten to match, as an attacker
ships it (a CRC is no signature).

- :func:`craft_metadata`: dist-checkpointing's ``.metadata`` (a plain pickle);
- :func:`craft_common`: megatron-core's ``common.pt`` (a torch.save archive);
- :func:`craft_byte_entry`: a sharded object inside a ``.distcp`` shard (the random state
  ``rng_state``, a layer's ``_extra_state``): the crafted archive is appended to its shard
  and ``.metadata`` points at it;
- :func:`craft_torch_file`: any torch.save archive (an earlier version's ``rng/rank_*.pt``).
"""

import io
import os
import pickle
import zipfile

from megatron_jreg.checkpoint.manifest import write_manifest


def command_prefix(marker) -> bytes:
    """Pickle opcodes that call ``os.system("touch MARKER")`` and drop its result: placed
    after the PROTO opcode of any pickle, the rest unpickles as before."""
    command = f"touch {marker}".encode("raw_unicode_escape")
    return b"cos\nsystem\n(V" + command + b"\ntR0"


def crafted_pickle(data: bytes, marker) -> bytes:
    assert data[:1] == b"\x80", "a pickle of protocol 2 or later starts with PROTO"
    return data[:2] + command_prefix(marker) + data[2:]


def craft_torch_file(data: bytes, marker) -> bytes:
    """``data`` (a torch.save zip archive) with its ``data.pkl`` crafted."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.endswith("/data.pkl"):
                body = crafted_pickle(body, marker)
            dst.writestr(info, body)
    return out.getvalue()


def _craft(path, name, craft, marker) -> str:
    """Replace ``path``/``name`` by ``craft(its bytes, marker)`` and rewrite the manifest to
    match (an attacker ships a matching one)."""
    file = os.path.join(path, name)
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(craft(data, marker))
    write_manifest(str(path))
    return file


def craft_metadata(path, marker) -> str:
    return _craft(path, ".metadata", crafted_pickle, marker)


def craft_common(path, marker) -> str:
    return _craft(path, "common.pt", craft_torch_file, marker)


def craft_byte_entry(path, key_prefix, marker) -> str:
    """The first byte entry whose key starts with ``key_prefix``, crafted; returns its
    shard's path and key as a refusal names them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta_file = os.path.join(path, ".metadata")
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)  # our own save: trusted here
    key = next(k for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and k.startswith(key_prefix))
    index = MetadataIndex(key)
    info = metadata.storage_data[index]
    shard = os.path.join(path, info.relative_path)
    with open(shard, "rb") as f:
        f.seek(info.offset)
        blob = craft_torch_file(f.read(info.length), marker)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(blob))
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(str(path))
    return f"{shard} (entry {key})"


def load_rng_files(path, rank):
    """The load's step that reads an earlier version's ``rng/rank_N.pt`` of iteration
    directory ``path``, over the trusted open's handle of that directory."""
    import types

    from megatron_jreg.checkpoint import catalog, formats, loading, trusted

    ref = catalog.Ref(os.path.dirname(str(path)), 2, str(path))
    opened = trusted.Opened(ref, trusted.check_tree(str(path)), None, {}, {})
    fmt = types.SimpleNamespace(saved_world=formats._saved_world(opened))
    loading._load_rng_files(types.SimpleNamespace(path=str(path), opened=opened, format=fmt), rank)
