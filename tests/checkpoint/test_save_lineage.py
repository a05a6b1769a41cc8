"""One lineage per --save, no iteration lost or mixed.

What these tests prove:
- a run writes into a --save that holds iterations only to continue the latest of them:
  --finetune or --no-load-optim from --save's own weights (both restart at iteration 0)
  and --ckpt-step of an earlier iteration are refused before any work, naming --save, what
  it holds and the fixes, and leave it untouched; --overwrite-checkpoints lets them, and a
  resume of the latest, or --pretrained-checkpoint into an empty --save or one the run
  already saved into, goes on;
- a save killed between its two renames (the old iter_N moved aside, the new one not yet
  in place) loses nothing: the next run finishes it (the whole partial becomes iter_N,
  else the replaced copy goes back) and resumes with the losses of an uninterrupted run;
  a tool reading the directory names the whole copy and how to put it back;
- resuming a run begun from one --pretrained-checkpoint with another is refused naming
  both (a run begun without one: a note), and a manifest that lists no files is no check.
"""

import json
import os
import shutil

import pytest
from trainer_runs import base_args, read_metrics, train

from megatron_jreg.checkpoint import catalog
from megatron_jreg.checkpoint.dist_checkpoint import COMPLETE, TRACKER, iteration_dir
from megatron_jreg.checkpoint.manifest import MANIFEST, verify_manifest
from megatron_jreg.checkpoint.run_configs import checkpoint_sources
from megatron_jreg.commands.train import from_argv

COMMON = dict(train_iters=6, save_interval=2, lr_decay_iters=6)


@pytest.fixture(scope="module")
def runs(demo_data, tmp_path_factory):
    """An uninterrupted 6-step run (its metrics), the same run stopped after iteration 4
    (saves 2 and 4), and iteration 4 of a run with another seed."""
    root = tmp_path_factory.mktemp("lineage")
    train(base_args(demo_data, save=root / "full", metrics_file=root / "full.jsonl", **COMMON))
    train(base_args(demo_data, save=root / "part", exit_interval=4, **COMMON))
    train(base_args(demo_data, save=root / "other", exit_interval=4, seed=7, **COMMON))
    return {"full": read_metrics(root / "full.jsonl"), "part": root / "part",
            "other": root / "other"}


def _copy(runs, tmp_path, name="part"):
    ckpt = tmp_path / name
    shutil.copytree(runs[name], ckpt)
    return ckpt


def _listing(ckpt):
    return sorted(n for n in os.listdir(ckpt) if n != "jreg_writer.lock")


def _refused(proc):
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and "iteration " not in proc.stdout
    return lines[-1]


# ---- a run continues --save's latest iteration, or is told ---------------------------------

def test_finetune_from_save_into_save_is_refused_and_leaves_it(demo_data, runs, tmp_path):
    """Was: --finetune --load P --save P wrote fine-tuned weights over P's iter_0000002 and
    moved the tracker from 4 to 2, without a word."""
    ckpt = _copy(runs, tmp_path)
    before = {n: open(os.path.join(iteration_dir(str(ckpt), 2), n), "rb").read()
              for n in os.listdir(iteration_dir(str(ckpt), 2)) if n.endswith(".distcp")}
    proc = train(base_args(demo_data, train_iters=2, finetune=True, load=ckpt, save=ckpt),
                 check=False)
    err = _refused(proc)
    assert err == (f"error: --save {ckpt} already holds checkpoints (iter_0000002, iter_0000004, "
                   f"{TRACKER}) and this run starts at iteration 0 from the weights there "
                   "(--finetune), so its saves would replace them: pass another --save for the "
                   f"new run (--load {ckpt} still reads from there), or --overwrite-checkpoints "
                   "to replace them"), err
    assert open(ckpt / TRACKER).read() == "4"
    assert _listing(ckpt) == ["iter_0000002", "iter_0000004", TRACKER]
    for name, data in before.items():
        assert open(os.path.join(iteration_dir(str(ckpt), 2), name), "rb").read() == data
    # the fix it names: another --save
    ok = train(base_args(demo_data, train_iters=2, finetune=True, load=ckpt,
                         save=tmp_path / "tuned"))
    assert "fine-tuning from --load" in ok.stdout
    assert open(ckpt / TRACKER).read() == "4"


def _fake_save(root, iterations, tracker=None, torn=()):
    """A --save directory of whole (marked) and torn iteration directories."""
    os.makedirs(root)
    for i in iterations:
        os.makedirs(iteration_dir(str(root), i))
        if i not in torn:
            open(os.path.join(iteration_dir(str(root), i), COMPLETE), "w").write("{}")
    if tracker is not None:
        open(root / TRACKER, "w").write(str(tracker))
    return root


@pytest.mark.parametrize("flags, iterations, refusal", [
    ({"finetune": True}, (2, 4), "starts at iteration 0 from the weights there (--finetune)"),
    ({"no_load_optim": True}, (2, 4),
     "starts at iteration 0 from the weights there (--no-load-optim)"),
    ({"ckpt_step": 2}, (2, 4, 6), "--ckpt-step 2 resumes from an earlier iteration of --save "
     "{save}, which holds later ones (iter_0000004, iter_0000006): this run's saves would "
     f"replace them and set {TRACKER} back; drop --ckpt-step to continue from the latest, pass "
     "another --save to branch from iteration 2, or --overwrite-checkpoints to replace them"),
    ({"pretrained": True}, (4,), None),  # a requeued run begun from --pretrained-checkpoint
    ({"pretrained": True}, (), None),  # its first start: --save is empty
    ({"pretrained": True, "finetune": True}, (2, 4), None),
    ({"pretrained": True, "torn": (4,)}, (4,),
     "starts at iteration 0 from --pretrained-checkpoint {pre} (--load holds no whole "
     "checkpoint to continue)"),
    ({}, (2, 4), None),  # a plain resume
    ({"ckpt_step": 4}, (2, 4), None),  # the latest, named
    ({"ckpt_step": 2, "torn": (4,)}, (2, 4), None),  # a torn later one holds nothing to lose
    ({"finetune": True, "overwrite_checkpoints": True}, (2, 4), None),
    ({"ckpt_step": 2, "overwrite_checkpoints": True}, (2, 4), None),
], ids=["finetune", "no_load_optim", "ckpt_step_earlier", "pretrained_resume",
        "pretrained_first_start", "pretrained_finetune_resume", "pretrained_over_torn",
        "resume", "ckpt_step_latest", "ckpt_step_over_torn", "finetune_overwrite",
        "ckpt_step_overwrite"])
def test_what_may_write_into_its_own_load(demo_data, tmp_path, flags, iterations, refusal):
    flags = dict(flags)
    pre = _fake_save(tmp_path / "pre", (1,), tracker=1)
    if flags.pop("pretrained", False):
        flags["pretrained_checkpoint"] = pre
    torn = flags.pop("torn", ())
    whole = [i for i in iterations if i not in torn]
    save = _fake_save(tmp_path / "save", iterations, tracker=whole[-1] if whole else None,
                      torn=torn)
    experiment = from_argv(base_args(demo_data, load=save, save=save, **flags))
    if refusal is None:
        experiment.check_save_lineage(catalog.scan(str(save)))
        return
    with pytest.raises(ValueError) as err:
        experiment.check_save_lineage(catalog.scan(str(save)))
    assert refusal.format(save=save, pre=pre) in str(err.value), str(err.value)
    assert str(err.value).startswith(f"--save {save}" if "ckpt_step" not in flags
                                     else "--ckpt-step")


def test_an_earlier_step_counts_the_whole_copy_a_killed_save_left(demo_data, tmp_path):
    """iter_0000004 exists only as a killed save's whole partial: it is an iteration of
    --save all the same (the run's lock puts it back), so --ckpt-step 2 is refused."""
    save = _fake_save(tmp_path / "save", (2,), tracker=4)
    partial = save / "iter_0000004.partial-x"
    os.makedirs(partial)
    open(partial / COMPLETE, "w").write("{}")
    with pytest.raises(ValueError, match="holds later ones \\(iter_0000004\\)"):
        from_argv(base_args(demo_data, load=save, save=save, ckpt_step=2)).check_save_lineage(
            catalog.scan(str(save)))


# ---- a save killed between its renames ------------------------------------------------------

def _killed_between_renames(runs, tmp_path, partial_whole=True):
    """The state a kill between _complete's two renames leaves while the run re-saves
    iteration 4: the old iter_0000004 (here another seed's) moved to .replaced-x, the new
    save (this run's) whole under .partial-y, no iter_0000004, the tracker untouched."""
    ckpt = _copy(runs, tmp_path)
    four = iteration_dir(str(ckpt), 4)
    if partial_whole:
        shutil.copytree(iteration_dir(str(runs["other"]), 4), four + ".replaced-x")
        os.replace(four, four + ".partial-y")
    else:  # the partial was removed (or never marked): the replaced copy is all there is
        os.replace(four, four + ".replaced-x")
        os.makedirs(four + ".partial-y")
    return ckpt


@pytest.mark.parametrize("partial_whole", [True, False], ids=["partial_marked", "replaced_only"])
def test_a_save_killed_between_its_renames_is_finished(demo_data, runs, tmp_path, partial_whole):
    """Was: the resume stopped with 'iteration 4 is not under ...', and a run with that
    --save removed both whole copies as unfinished saves."""
    ckpt = _killed_between_renames(runs, tmp_path, partial_whole)
    metrics = tmp_path / "resumed.jsonl"
    proc = train(base_args(demo_data, load=ckpt, save=ckpt, metrics_file=metrics, **COMMON))
    kept = "iter_0000004.partial-y" if partial_whole else "iter_0000004.replaced-x"
    assert f"recovered iteration 4: {kept} is now iter_0000004" in proc.stdout, proc.stdout[-3000:]
    assert f"loaded checkpoint {ckpt} iteration 4" in proc.stdout
    assert _listing(ckpt) == ["iter_0000002", "iter_0000004", "iter_0000006", TRACKER]
    resumed, full = read_metrics(metrics), runs["full"]
    assert [r["iteration"] for r in resumed] == [5, 6]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in full[4:]]


def test_a_tool_reads_the_whole_copy_as_the_trainer_does(runs, tmp_path, capsys):
    """Was: eval_jump refused the directory and asked for a rename while the trainer read
    the whole copy. Readers do not rename (they hold no lock): every reader reads the copy
    where it is and says so in one line, without deleting anything."""
    ckpt = _killed_between_renames(runs, tmp_path)
    copy = ckpt / "iter_0000004.partial-y"
    (source,) = checkpoint_sources(str(ckpt), iteration=4)
    assert source.path == str(copy) and source.iteration == 4
    assert f"iteration 4 is read from {copy.name}" in capsys.readouterr().out
    # the interrupted save's copy is the directory's only whole iteration (and no tracker):
    # still read
    for name in os.listdir(ckpt):
        if name.startswith("iter_") and name[5:].isdigit():
            shutil.rmtree(ckpt / name)
    os.remove(ckpt / TRACKER)
    (source,) = checkpoint_sources(str(ckpt))
    assert source.path == str(copy)
    assert copy.is_dir()


# ---- a resume names the --pretrained-checkpoint its run began from --------------------------

def test_resume_with_another_pretrained_checkpoint_is_refused(demo_data, runs, tmp_path):
    """Was: a run begun from --pretrained-checkpoint A, resumed with B, continued A's
    lineage and never read B, without a word."""
    began, other, run = runs["part"], runs["other"], tmp_path / "run"
    tune = dict(train_iters=2, lr_decay_iters=4, save=run, load=run)
    train(base_args(demo_data, pretrained_checkpoint=began, **tune))
    proc = train(base_args(demo_data, pretrained_checkpoint=other,
                           **dict(tune, train_iters=3)), check=False)
    err = _refused(proc)
    assert err == (f"error: --load {run} holds a run begun from --pretrained-checkpoint {began}, "
                   f"not {other}, and this run would continue it without reading {other}; pass "
                   f"--pretrained-checkpoint {began} to continue it, or another --save (and "
                   f"--load) to start a new run from {other}"), err
    assert open(run / TRACKER).read() == "2"
    ok = train(base_args(demo_data, pretrained_checkpoint=began, **dict(tune, train_iters=3)))
    assert f"loaded checkpoint {run} iteration 2" in ok.stdout
    # a run begun without one: resumed all the same, with a line saying the flag is not read
    scratch = _copy(runs, tmp_path)
    noted = train(base_args(demo_data, pretrained_checkpoint=other, load=scratch, save=scratch,
                            **dict(COMMON, train_iters=5)))
    assert (f"note: --pretrained-checkpoint {other} is not read: --load {scratch} holds a run "
            "begun without it, and this run continues that one") in noted.stdout


# ---- a manifest that lists nothing checks nothing -------------------------------------------

@pytest.mark.parametrize("manifest", [{"algorithm": "crc32", "files": {}}, {"algorithm": "crc32"},
                                      {"algorithm": "crc32", "files": None}, []],
                         ids=["empty", "no_key", "null", "not_an_object"])
def test_a_manifest_without_files_fails_verification(runs, tmp_path, manifest):
    path = iteration_dir(str(_copy(runs, tmp_path)), 4)
    assert verify_manifest(path) is None  # the saved one passes
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    problem = verify_manifest(path)
    assert problem == (f"{os.path.join(path, MANIFEST)} lists no files to check (a save's "
                       "manifest lists every file it wrote)"), problem


def test_a_resume_refuses_an_emptied_manifest(demo_data, runs, tmp_path):
    ckpt = _copy(runs, tmp_path)
    path = iteration_dir(str(ckpt), 4)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"algorithm": "crc32", "files": {}}, f)
    proc = train(base_args(demo_data, load=ckpt, **dict(COMMON, train_iters=5)), check=False)
    err = _refused(proc)
    assert (f"checkpoint {path} fails its checksum: {os.path.join(path, MANIFEST)} "
            "lists no files") in err
