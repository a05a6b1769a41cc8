"""What a save killed midway leaves in its directory, and how the next writer puts it right.

A save of iteration N is written to ``iter_N.partial-RUNID``. Once every rank's files and
the manifest are there, rank 0 writes the completion marker into it; then only renames are
left (``dist_checkpoint._complete``): an ``iter_N`` already there (the run resumed from an
earlier iteration) moves to ``iter_N.replaced-RUNID``, the partial becomes ``iter_N``, the
replaced copy is removed and the tracker file is updated.

The rule: a save is committed once its marker is written. After that the directory is
whole and nothing but renames remains, so a kill is finished, not undone: a whole partial
becomes ``iter_N`` (a present ``iter_N`` is the copy it was replacing). Without a whole
partial, an ``iter_N.replaced-*`` with no ``iter_N`` beside it is put back: it is what
``iter_N`` was before (a kill between the two renames of a partial that was then removed
by hand). Either way no iteration ever saved is left without an ``iter_N``, and what
remains is never the only copy of an iteration: partials without the marker (saves that
never finished) and replaced copies of a present ``iter_N``; the writer removes those
(``training.checkpointing``). The tracker is left alone: it names the last save that
finished in full, and a resume from it takes the same steps again.

Readers never rename (they may not hold the lock): the catalog (catalog.py) tells them
where an iteration missing under its own name is whole, and they read it there.
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
