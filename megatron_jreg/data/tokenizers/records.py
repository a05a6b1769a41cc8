"""What a tokenizer's record says: which ids it holds, and the record this project wrote
for the same files before records said so.

A tokenizer's ``unique_identifiers`` is its record: megatron-core's ``GPTDataset`` folds it into
its cache, and its sha256 (:func:`identity`) pins a run in ``run_config.yaml``. A type with two
sets of ids names them in ``ids`` (``MEGATRON_CORE_IDS`` or ``LEGACY_IDS``); an older record
without ``ids`` is read through :class:`EarlierRecord`. Imports neither torch nor megatron-core.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

# the ``ids`` of a record: Megatron-LM's default (megatron.core.tokenizers) or its legacy ids
MEGATRON_CORE_IDS = "megatron-core"
LEGACY_IDS = "legacy"


def identity(record: dict) -> str:
    """The sha256 of a record (kind, vocabulary size, files' content hashes; no path), so a
    moved copy matches and a retrained file at the same path does not."""
    text = json.dumps(record, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class EarlierRecord:
    """The record this project wrote for a tokenizer's files before records named their
    ids, and what it means for a run with this tokenizer."""

    record: dict
    """That record (``unique_identifiers`` as it was then)."""
    same_ids: bool
    """Whether it holds the ids and vocabulary this tokenizer gives."""
    kind: str
    """The ``--tokenizer-type`` that gives its ids now ..."""
    legacy: bool
    """... with or without ``--legacy-tokenizer``."""
    fix: str
    """One line for a run whose ids differ from it: what it held and the flag to pass."""


def earlier_record_fix(tokenizer, pinned: Optional[str]) -> Optional[str]:
    """The one-line fix when ``pinned`` is the earlier record of this tokenizer's files and
    holds other ids than this tokenizer gives; None otherwise."""
    earlier = getattr(tokenizer, "earlier_record", None)
    if pinned is None or earlier is None or earlier.same_ids:
        return None
    return earlier.fix if identity(earlier.record) == pinned else None


def holds_same_ids(tokenizer, pinned: Optional[str]) -> bool:
    """Whether a run pinned to ``pinned`` has this tokenizer's ids and vocabulary: its own
    identity, or the earlier record of the same ids."""
    if pinned is None:
        return False
    if identity(tokenizer.unique_identifiers) == pinned:
        return True
    earlier = getattr(tokenizer, "earlier_record", None)
    return bool(earlier and earlier.same_ids and identity(earlier.record) == pinned)


def other_ids_fix(tokenizer, pinned: Optional[str]) -> Optional[str]:
    """The one-line fix when ``pinned`` is this tokenizer's own record but with its type's
    other ids (the run used ``--legacy-tokenizer`` and this one does not, or the reverse);
    None otherwise."""
    record = tokenizer.unique_identifiers
    if pinned is None or record.get("ids") not in (MEGATRON_CORE_IDS, LEGACY_IDS):
        return None
    other = LEGACY_IDS if record["ids"] == MEGATRON_CORE_IDS else MEGATRON_CORE_IDS
    if identity(dict(record, ids=other)) != pinned:
        return None
    if other == LEGACY_IDS:
        return ("its run used --legacy-tokenizer (Megatron-LM's legacy ids of "
                f"{record.get('class')}); pass --legacy-tokenizer")
    return ("its run did not use --legacy-tokenizer (Megatron-LM's default ids of "
            f"{record.get('class')}); drop --legacy-tokenizer")
