"""``--data-path`` read once: the dataset prefixes and, for a weighted blend, their weights.

``--data-path`` is Megatron-LM's: plain prefixes (``a_text_document b_text_document``), or
weight/prefix pairs (``0.7 a_text_document 0.3 b_text_document``). The trainer's checks
(``batches.data_prefixes``) and the datasets it builds (``gpt.GPTDataConfig.blend``) both
read it through :func:`parse_data_path`, so they always see the same prefixes.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None) of ``--data-path``.

    Weight/prefix pairs when the list has an even length and every other item, from the
    first, reads as a number; otherwise every item is a prefix and there are no weights.
    Weights are returned as given; ``GPTDataConfig.blend`` refuses those that are not > 0.
    """
    items = list(data_path)
    if items and len(items) % 2 == 0:
        try:
            weights = [float(x) for x in items[0::2]]
        except ValueError:
            pass
        else:
            return items[1::2], weights
    return items, None
