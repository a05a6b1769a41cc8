"""Every reader of a save directory gives the same verdict on every state it can be in: the
trainer's resume (``training.source.starting_point``), ``--use-checkpoint-args``
(``checkpoint_args.checkpoint_configs``) and the tools (``run_configs.checkpoint_sources``:
eval_jump, convert_to_hf, eval_downstream). Each either reads the same iteration from the
same directory, or raises the same fault with the same facts, phrased in its own flags: the
catalog's fault in the trainer's words (``--ckpt-step``) or the tools' (``--iteration``)."""

import json
import os
import shutil
import zlib

import pytest
from checkpoint_runs import ITERS

from megatron_jreg.checkpoint import catalog, faults, formats
from megatron_jreg.checkpoint.interrupted import COMPLETE
from megatron_jreg.checkpoint.run_configs import checkpoint_sources
from megatron_jreg.config.run import CheckpointConfig
from megatron_jreg.training.checkpoint_args import checkpoint_configs
from megatron_jreg.training.source import starting_point

NAME = catalog.iteration_name(ITERS)


def _tracker(root, text):
    (root / catalog.TRACKER).write_text(text)


def _no_tracker(root):
    os.remove(root / catalog.TRACKER)


def _marked_partial(root):
    os.replace(root / NAME, root / f"{NAME}.partial-y")


def _hf_import(root):
    """What tools/convert_from_hf.py writes: a run config naming the imported model, the
    manifest's entry for it updated (a whole save of ours otherwise)."""
    config, manifest = root / NAME / catalog.RUN_CONFIG, root / NAME / catalog.MANIFEST
    data = config.read_bytes().replace(b"imported_from: null", b"imported_from: SmolLM2-135M")
    config.write_bytes(data)
    entries = json.loads(manifest.read_text())
    entries["files"][catalog.RUN_CONFIG] = {"size": len(data), "crc32": zlib.crc32(data)}
    manifest.write_text(json.dumps(entries))


def _megatron_lm(root):
    for name in (COMPLETE, catalog.MANIFEST, catalog.RUN_CONFIG):
        os.remove(root / NAME / name)


# state -> (how to make it from a whole copy, expected: iteration read, or the fault's class)
STATES = {
    "whole": (None, ITERS),
    "torn": (lambda r: os.remove(r / NAME / COMPLETE), faults.TornIteration),
    "killed_between_renames": (_marked_partial, ITERS),
    "marked_partial_no_tracker": (lambda r: (_marked_partial(r), _no_tracker(r)), ITERS),
    "tracker_ahead": (lambda r: _tracker(r, "9"), faults.IterationAbsent),
    "tracker_behind": (lambda r: _tracker(r, "1"), faults.IterationAbsent),
    "tracker_missing": (_no_tracker, ITERS),
    "tracker_garbage": (lambda r: _tracker(r, "\x00\xffxyz"), faults.TrackerUnreadable),
    "megatron_lm": (_megatron_lm, ITERS),
    "hf_import": (_hf_import, ITERS),
    "empty": (lambda r: shutil.rmtree(r) or os.makedirs(r), faults.NoCheckpoint),
    "foreign": (lambda r: shutil.rmtree(r) or os.makedirs(r) or (r / "notes.txt").write_text("x"),
                faults.NoCheckpoint),
    "missing": (lambda r: shutil.rmtree(r), faults.NoDirectory),
    "a_file": (lambda r: shutil.rmtree(r) or r.write_text("x"), faults.NoDirectory),
    "iteration_dir_given": ("iteration", faults.IterationDirectoryGiven),
}


def _trainer(root):
    return starting_point(CheckpointConfig(load=root))


def _checkpoint_args(root):
    return checkpoint_configs({"load": root})


def _tools(root):
    (source,) = checkpoint_sources(root)
    return source


KINDS = {"megatron_lm": formats.MEGATRON_LM, "hf_import": formats.HF_IMPORT}
READERS = {"trainer": (_trainer, faults.TRAINER),
           "use_checkpoint_args": (_checkpoint_args, faults.TRAINER),
           "tools": (_tools, faults.TOOLS)}


def _verdict(read, root):
    try:
        got = read(root)
    except (faults.CheckpointFault, faults.UnsafeCheckpoint) as err:
        return err
    source = getattr(got, "source", got)
    return source.iteration, source.path, source.format.kind


@pytest.mark.parametrize("state", list(STATES))
def test_every_reader_gives_the_same_verdict(checkpoint, tmp_path, state):
    make, expected = STATES[state]
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    if make == "iteration":
        root = root / NAME
    elif make is not None:
        make(root)
    verdicts = {name: _verdict(read, str(root)) for name, (read, _) in READERS.items()}
    if isinstance(expected, int):
        paths = {v if isinstance(v, BaseException) else v[1] for v in verdicts.values()}
        assert all(not isinstance(v, BaseException) and v[0] == expected
                   for v in verdicts.values()), verdicts
        assert len(paths) == 1 and os.path.isdir(paths.pop())
        kinds = {v[2] for v in verdicts.values()}
        assert kinds == {KINDS.get(state, formats.OURS)}, kinds
        return
    truth = catalog.scan(str(root))
    with pytest.raises(expected) as caught:
        truth.resolve()
    for name, verdict in verdicts.items():
        assert type(verdict) is expected, (name, verdict)
        assert verdict.facts == caught.value.facts, (name, verdict.facts)
        wording = READERS[name][1]
        # what the command prints: the trainer its error's text, a tool run_command's phrasing
        said = str(verdict) if wording is faults.TRAINER else faults.phrase(verdict, wording)
        assert said == caught.value.phrase(wording), (name, said)
    if "--ckpt-step" in caught.value.phrase(faults.TRAINER):
        assert "--iteration" in faults.phrase(verdicts["tools"], faults.TOOLS)
