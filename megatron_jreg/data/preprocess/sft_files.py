"""The files of an SFT dataset, as ``tools/preprocess_data.py --sft`` names and writes them;
``data.datasets.sft.SFTDataset`` reads them back for training.

For ``--output-prefix OUT`` the dataset prefix is ``P = OUT_sft_document``: ``P.bin``/``.idx``
the token ids (``writer``'s format, one sequence per rendered conversation);
``P_loss_mask.bin``/``.idx`` the same format in uint8, 1 on each assistant message's content
and its end-of-turn token; ``P.json`` the metadata (chat template, tokenizer, EOD id, counts;
its ``format`` is ``FORMAT``).
"""

from __future__ import annotations

import json

from megatron_jreg.atomic_write import write_text_atomic

FORMAT = "megatron-jreg sft 1"
MASK_SUFFIX = "_loss_mask"


def sft_prefixes(output_prefix: str) -> list[str]:
    """The token and loss-mask dataset prefixes that ``--output-prefix`` gives."""
    prefix = f"{output_prefix}_sft_document"
    return [prefix, prefix + MASK_SUFFIX]


def metadata_path(prefix: str) -> str:
    return prefix + ".json"


def write_metadata(prefix: str, metadata: dict) -> None:
    """Written last, under a temporary name: its counts vouch for the two datasets."""
    text = json.dumps(metadata, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    write_text_atomic(metadata_path(prefix), text)
