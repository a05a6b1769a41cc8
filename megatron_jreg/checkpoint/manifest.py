"""Per-file checksums of an iteration directory, written before its completion marker.

``jreg_manifest.json`` maps every file's path (relative to the iteration directory) to its
size and CRC-32: dist-checkpointing has no checksums of its own. The save writes it
(:func:`write_manifest`, every rank hashing a share) and the trusted open checks it
(:func:`verify_manifest`), naming the file that changed.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron_jreg.checkpoint.faults import DamagedFile
from megatron_jreg.checkpoint.files import open_regular

MANIFEST = "jreg_manifest.json"
CHUNK = 8 << 20
# written after the manifest: never listed in it
UNLISTED = {MANIFEST, "jreg_complete.json"}


def file_crc32(path: str, opener=None) -> int:
    crc = 0
    with (opener(path) if opener else open(path, "rb")) as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def listed_files(directory: str) -> List[str]:
    """Every regular file under ``directory`` (relative paths, sorted) except the unlisted."""
    found = []
    for base, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(base, name), directory)
            if rel not in UNLISTED:
                found.append(rel)
    return sorted(found)


def _hash_share(directory: str, files: List[str], threads: Optional[int] = None,
                opener=None) -> Dict[str, Dict]:
    def one(rel):
        path = os.path.join(directory, rel)
        open_one = (lambda f: opener(f, directory)) if opener else None
        return rel, {"size": os.path.getsize(path), "crc32": file_crc32(path, open_one)}

    threads = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(pool.map(one, files))


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_to_all(local: Dict) -> Dict:
    rank, world = _rank_world()
    if world == 1:
        return local
    parts: List[Optional[Dict]] = [None] * world
    dist.all_gather_object(parts, local)
    merged: Dict = {}
    for part in parts:
        merged.update(part or {})
    return merged


def write_manifest(directory: str) -> None:
    """Hash every file of ``directory`` (collective when distributed) and write the
    manifest from rank 0. The caller writes the completion marker after this returns."""
    rank, world = _rank_world()
    files = [listed_files(directory)]
    if world > 1:
        # one list: ranks may see the fs at different times
        dist.broadcast_object_list(files, src=0)
    mine = files[0][rank::world]
    entries = _gather_to_all(_hash_share(directory, mine))
    if rank == 0:
        tmp = os.path.join(directory, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"algorithm": "crc32", "files": entries}, f, indent=0, sort_keys=True)
        os.replace(tmp, os.path.join(directory, MANIFEST))


def read_entries(directory: str) -> Dict[str, Dict]:
    """The manifest's {file: {size, crc32}} of ``directory``; empty when it has none (saved
    before manifests existed: not checked). Raises DamagedFile for a manifest that checks
    nothing or cannot be read."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        return {}
    try:
        with open_regular(path, directory) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise DamagedFile(path=directory, checksum=True,
                          detail=f"{path} is unreadable ({type(err).__name__})") from None
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    # every save lists at least its shards and metadata: an empty or absent list would
    # check nothing and pass
    if not isinstance(entries, dict) or not entries:
        raise DamagedFile(path=directory, checksum=True, detail=(
            f"{path} lists no files to check (a save's manifest lists every file it wrote)"))
    if not all(isinstance(e, dict) and type(e.get("size")) is int
               and type(e.get("crc32")) is int for e in entries.values()):
        raise DamagedFile(path=directory, checksum=True,
                          detail=f"{path} has an entry without an integer size and crc32")
    return entries


def mismatch(file: str, size: int, crc32: Optional[int], entry: Dict) -> Optional[str]:
    """What differs between ``file`` (``size`` bytes, ``crc32``: None when not hashed) and
    its manifest ``entry``, in one line; None when nothing does."""
    if size != entry["size"]:
        return f"{file} has {size} bytes, the manifest {entry['size']}"
    if crc32 != entry["crc32"]:
        return f"{file} changed since it was saved (CRC-32 mismatch)"
    return None


def verify_files(directory: str, entries: Dict[str, Dict], skip=(), opener=None) -> Optional[str]:
    """None when every file of ``entries`` but ``skip`` has its recorded size and CRC-32
    (collective when distributed: each rank hashes its share); else one line naming the
    first file that differs. ``opener(file, directory)`` opens a file to hash."""
    rank, world = _rank_world()
    names = sorted(n for n in entries if n not in skip)[rank::world]
    problems = []
    present = [n for n in names if os.path.isfile(os.path.join(directory, n))]
    problems += [f"{os.path.join(directory, n)} is missing" for n in names if n not in present]
    same_size = [n for n in present
                 if os.path.getsize(os.path.join(directory, n)) == entries[n]["size"]]
    actual = _hash_share(directory, same_size, opener=opener)
    for n in present:
        full = os.path.join(directory, n)
        got = actual.get(n) or {"size": os.path.getsize(full), "crc32": None}
        why = mismatch(full, got["size"], got["crc32"], entries[n])
        if why:
            problems.append(why)
    merged = _gather_to_all({str(rank): problems})
    everything = [p for r in sorted(merged, key=int) for p in merged[r]]
    return everything[0] if everything else None


def verify_manifest(directory: str) -> Optional[str]:
    """None when every file the manifest of ``directory`` lists has its recorded size and
    CRC-32 (collective when distributed), or it has no manifest; else one line naming the
    first that differs (the benches' and tests' check of a whole directory)."""
    try:
        entries = read_entries(directory)
    except DamagedFile as err:
        return err.detail
    return verify_files(directory, entries) if entries else None
