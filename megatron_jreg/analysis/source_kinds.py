"""The registry of source kinds eval_jump offers; the only module that imports them all."""

from __future__ import annotations

from typing import List

from megatron_jreg.analysis.checkpoint_source import CHECKPOINT_SOURCE_KIND
from megatron_jreg.analysis.hf_source import HF_SOURCE_KIND
from megatron_jreg.analysis.sources import SourceKind


def builtin_source_kinds() -> List[SourceKind]:
    """Every source kind eval_jump offers. Add a kind here."""
    return [HF_SOURCE_KIND, CHECKPOINT_SOURCE_KIND]
