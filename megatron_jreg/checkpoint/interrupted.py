"""What a save killed midway leaves in its directory, and how the next writer puts it right.

A save is committed once its completion marker is written; a kill after that is finished,
not undone: :func:`left_whole_of` finds the whole copy left under a temporary name
(``iter_N.partial-RUNID`` or ``iter_N.replaced-RUNID``) and :func:`finish_interrupted_saves`
(the writer, ``training.checkpointing``, holding the lock) renames it to ``iter_N``.
Readers never rename: the catalog (catalog.py) tells them where such a copy is.
"""

from __future__ import annotations

import os
from typing import Dict, List

COMPLETE = "jreg_complete.json"  # written last into a save of ours: the directory is whole
MARKED_SUFFIXES = ("partial", "replaced")  # iter_N.partial-RUNID, iter_N.replaced-RUNID


def left_whole_of(root: str, names, iteration_dirs) -> Dict[int, str]:
    """{iteration: name under ``root``} of each whole copy a killed save left under a
    temporary name, among ``names`` (``root``'s listing; ``iteration_dirs``: the iterations
    with an ``iter_N`` directory): the newest whole partial, else, with no ``iter_N``, the
    newest replaced copy. :func:`finish_interrupted_saves` makes each ``iter_N``."""
    best: Dict[int, tuple] = {}
    for name in names:
        head, _, kind = name.partition(".")
        if not (head.startswith("iter_") and head[5:].isdigit()):
            continue
        path = os.path.join(root, name)
        partial = kind.startswith("partial") and os.path.isfile(os.path.join(path, COMPLETE))
        replaced = kind.startswith("replaced") and int(head[5:]) not in iteration_dirs
        if (partial or replaced) and os.path.isdir(path):
            key = (partial, os.path.getmtime(path), name)  # a whole partial first, then newest
            best[int(head[5:])] = max(best.get(int(head[5:]), key), key)
    return {iteration: key[2] for iteration, key in best.items()}


def finish_interrupted_saves(root: str, left_whole: Dict[int, str], run_id: str) -> List[str]:
    """Holding ``root``'s writer lock: rename each copy of ``left_whole`` (the catalog's)
    to ``iter_N`` (a present ``iter_N`` goes to ``iter_N.replaced-RUNID`` first, removed
    with the other leftovers afterwards). Returns a line per iteration put back."""
    lines = []
    for iteration, name in sorted(left_whole.items()):
        final = os.path.join(root, f"iter_{iteration:07d}")
        if os.path.isdir(final):
            os.replace(final, f"{final}.replaced-{run_id}")
        os.replace(os.path.join(root, name), final)
        how = ("a save killed after its completion marker, before its rename" if ".partial" in name
               else "the copy a save killed between its renames was replacing")
        lines.append(f"recovered iteration {iteration}: {name} is now {os.path.basename(final)} "
                     f"({how})")
    return lines
