"""Megatron-LM's checkpoint flags: --no-ckpt-fully-parallel-save / --ckpt-fully-parallel-load
and --async-save --use-persistent-ckpt-worker, with both formats of the distributed
optimizer.

Each save kind ({plain, fully parallel, async} x {dp_reshardable, fully_reshardable}) is an
uninterrupted 8-step DP2 run that saves iteration 4 on the way (the async one writes it
while steps 5-8 change the weights). Each checkpoint is resumed at 4 with a fully
parallel load at DP2, and at another layout the format allows (dp_reshardable: one
process; fully_reshardable: TP2 or PP2); the resumed losses equal the uninterrupted run's
(bit-exact at the same layout). The 2-process runs share one torchrun (trainer_sequence.py).

The async save's guarantees, on one process with its writer stopped (SIGSTOP): training
goes on while the save is pending and nothing marks it; a killed run leaves only its
.partial directory, which the next run removes before it resumes the previous whole
iteration exactly (and a SIGTERM then finishes its own save before the exit); a failed
write or a dead writer stops the run with one line, the iteration unmarked.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from trainer_runs import (
    REPO,
    base_args,
    read_metrics,
    read_until,
    run_env,
    start_trainer,
    step_of,
    train,
)

from megatron_jreg.checkpoint.dist_checkpoint import COMPLETE, TRACKER, iteration_dir

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = dict(train_iters=8, save_interval=4, seq_length=32, use_distributed_optimizer=True)
ASYNC = dict(async_save=True, use_persistent_ckpt_worker=True)
SAVES = {"plain": dict(no_ckpt_fully_parallel_save=True), "fully_parallel": {}, "async": ASYNC}
FORMATS = {"dp_reshardable": {}, "fully_reshardable": dict(dist_ckpt_optim_fully_reshardable=True)}
# the other 2-process layout a fully_reshardable checkpoint of each save kind resumes at
OTHER_LAYOUT = {"plain": dict(pipeline_model_parallel_size=2),
                "fully_parallel": dict(tensor_model_parallel_size=2),
                "async": dict(tensor_model_parallel_size=2)}
KINDS = [(save, fmt) for save in SAVES for fmt in FORMATS]


def _sequence(runs, tmp):
    """The command lines ``runs`` one after another in one 2-process torchrun."""
    listing = tmp / "runs.json"
    listing.write_text(json.dumps([[str(a) for a in argv] for argv in runs]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", os.path.join(HERE, "trainer_sequence.py"),
                           str(listing)], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def formats(demo_data, tmp_path_factory):
    """{(save, format): {"save": dir, "full": rows, "fp_load": rows, "other": rows}}, and
    the output of the torchrun."""
    root = tmp_path_factory.mktemp("formats")
    runs, out = [], {}
    for save, fmt in KINDS:
        d = root / f"{save}-{fmt}"
        out[save, fmt] = {"save": d / "ckpt", "dir": d}
        runs.append(base_args(demo_data, save=d / "ckpt", metrics_file=d / "full.jsonl",
                              **COMMON, **SAVES[save], **FORMATS[fmt]))
    for save, fmt in KINDS:
        d, resume = out[save, fmt]["dir"], dict(load=out[save, fmt]["save"], ckpt_step=4)
        runs.append(base_args(demo_data, metrics_file=d / "fp_load.jsonl",
                              ckpt_fully_parallel_load=True, **resume, **COMMON, **FORMATS[fmt]))
        if fmt == "fully_reshardable":
            runs.append(base_args(demo_data, metrics_file=d / "other.jsonl", **resume, **COMMON,
                                  **FORMATS[fmt], **OTHER_LAYOUT[save]))
    # an async save at --exit-interval: finished before the run exits
    exit_save = root / "exit"
    runs.append(base_args(demo_data, load=out["async", "dp_reshardable"]["save"], ckpt_step=4,
                          save=exit_save, exit_interval=6, **COMMON, **ASYNC))
    log = _sequence(runs, root)
    for save, fmt in KINDS:
        d = out[save, fmt]["dir"]
        for name in ("full", "fp_load", "other"):
            if (d / f"{name}.jsonl").exists():
                out[save, fmt][name] = read_metrics(d / f"{name}.jsonl")
    return out, log, exit_save


def _same(rows, reference, exact):
    assert [r["iteration"] for r in rows] == [5, 6, 7, 8]
    for got, want in zip(rows, reference[4:]):
        if exact:
            assert (got["lm_loss"], got["psi"], got["lr"]) == (want["lm_loss"], want["psi"],
                                                               want["lr"])
        else:
            assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5), got["iteration"]
            assert got["lr"] == want["lr"]


def _common(path):
    return torch.load(os.path.join(path, "common.pt"), weights_only=False)


def _rank_bytes(path, rank):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if n.startswith(f"__{rank}_") and n.endswith(".distcp"))


def test_every_save_kind_trains_alike_and_is_whole(formats):
    out, log, _ = formats
    reference = out["plain", "dp_reshardable"]["full"]
    assert len(reference) == 8 and reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    for kind in KINDS:
        assert [r["lm_loss"] for r in out[kind]["full"]] == [r["lm_loss"] for r in reference], kind
        save = str(out[kind]["save"])
        assert open(os.path.join(save, TRACKER)).read() == "8"
        assert sorted(os.listdir(save)) == ["iter_0000004", "iter_0000008", TRACKER], kind
        for it in (4, 8):
            path = iteration_dir(save, it)
            assert os.path.exists(os.path.join(path, COMPLETE)), (kind, it)
            common = _common(path)
            assert common["content_metadata"]["distrib_optim_sharding_type"] == kind[1]
            args = common["args"]
            assert (args.ckpt_fully_parallel_save, args.async_save) == (
                kind[0] != "plain", kind[0] == "async")
    # 2 runs x 2 saves, and the --exit-interval run's
    assert log.count("in the background (the loop waited") == 5
    # the fully parallel save spreads the weights both ranks hold over both: rank 1 writes
    # more than under the plain save, where rank 0 writes them all
    for fmt in FORMATS:
        plain = iteration_dir(str(out["plain", fmt]["save"]), 4)
        spread = iteration_dir(str(out["fully_parallel", fmt]["save"]), 4)
        assert _rank_bytes(spread, 1) > _rank_bytes(plain, 1), fmt


@pytest.mark.parametrize("kind", KINDS, ids=[f"{s}-{f}" for s, f in KINDS])
def test_each_save_resumes_exactly_under_a_fully_parallel_load(formats, kind):
    out = formats[0][kind]
    _same(out["fp_load"], out["full"], exact=True)


@pytest.mark.parametrize("save", list(SAVES))
def test_fully_reshardable_saves_resume_at_another_layout(formats, save):
    out = formats[0][save, "fully_reshardable"]
    _same(out["other"], out["full"], exact=False)


@pytest.mark.parametrize("save", list(SAVES))
def test_dp_reshardable_saves_resume_on_one_process(demo_data, formats, save, tmp_path):
    """dp_reshardable reloads at the same TP/PP with any number of data-parallel ranks."""
    out = formats[0][save, "dp_reshardable"]
    metrics = tmp_path / "dp1.jsonl"
    train(base_args(demo_data, load=out["save"], ckpt_step=4, metrics_file=metrics, **COMMON))
    _same(read_metrics(metrics), out["full"], exact=False)


def test_async_save_at_the_exit_interval_is_whole_before_the_exit(formats):
    _, log, exit_save = formats
    assert open(exit_save / TRACKER).read() == "6"
    assert os.path.exists(os.path.join(iteration_dir(str(exit_save), 6), COMPLETE))
    assert sorted(os.listdir(exit_save)) == ["iter_0000006", TRACKER]


def test_async_save_needs_the_persistent_worker_as_in_megatron_lm():
    """--async-save alone is off with a start-up line (Megatron-LM's validate_args drops it
    with a warning); with --use-persistent-ckpt-worker it is on, silently."""
    from megatron_jreg.commands.train import from_argv
    from megatron_jreg.config.megatron_lm import notes

    line = ("--async-save: off without --use-persistent-ckpt-worker, as in Megatron-LM: "
            "checkpoints are saved synchronously (add --use-persistent-ckpt-worker)")
    for argv, on in ((["--async-save"], False),
                     (["--async-save", "--use-persistent-ckpt-worker"], True)):
        run = from_argv(["--data-path", "x", *argv])
        assert run.checkpoint.async_save is on
        assert (line in notes(run, run.given, "local", "gloo")) is not on
    run = from_argv(["--data-path", "x"])
    assert (run.checkpoint.ckpt_fully_parallel_save, run.checkpoint.ckpt_fully_parallel_load,
            run.checkpoint.async_save) == (True, False, False)  # Megatron-LM's defaults
    for off in ("--no-ckpt-fully-parallel-save", "--disable-ckpt-fully-parallel-save"):
        assert from_argv(["--data-path", "x", off]).checkpoint.ckpt_fully_parallel_save is False


def test_fully_parallel_load_refuses_what_megatron_lm_refuses(monkeypatch):
    """A distributed optimizer saved dp_zero_gather_scatter (Megatron-LM before
    megatron-core 0.13: no content metadata, no fully parallel save) is refused, the flag
    named, before any tensor is read."""
    from types import SimpleNamespace

    from megatron_jreg.checkpoint import formats, loading
    from megatron_jreg.errors import CheckpointError

    monkeypatch.setattr(loading.ckpt, "is_distributed_optimizer", lambda optimizer: True)
    common = {"args": SimpleNamespace(ckpt_fully_parallel_save=False)}
    fmt = SimpleNamespace(sharding={}, saved_layout=None,
                          unnamed_sharding=formats.unnamed_sharding(common))
    source = SimpleNamespace(path="ckpt/iter_0000004", format=fmt)
    with pytest.raises(CheckpointError) as err:
        loading._optimizer_metadata(source, object(), fully_parallel=True)
    assert str(err.value) == (
        "checkpoint ckpt/iter_0000004 holds the distributed optimizer's state as "
        "dp_zero_gather_scatter (Megatron-LM before megatron-core 0.13), which a fully parallel "
        "load cannot read: drop --ckpt-fully-parallel-load")


# ---- the async save's guarantees, one process, its writer stopped ----------------------------

def _children(pid):
    """{child pid: its name} of process ``pid``."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if ppid == pid:
            found[int(entry)] = comm
    return found


def _writer(pid):
    """The pid of the background writer trainer ``pid`` started (named ckpt-writer)."""
    [writer] = [child for child, name in _children(pid).items() if name == "ckpt-writer"]
    return writer


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie holds nothing
    except OSError:
        return True


def _stalled_save(demo_data, tmp_path, **flags):
    """A run with its writer stopped after iteration 2's save is whole: returns (process,
    lines, save dir, writer pid, iteration 4's partial directory) once the run has trained
    on to step 6 with iteration 4's save pending (its save of 6 waits for it)."""
    ckpt = tmp_path / "ckpt"
    proc = start_trainer(base_args(demo_data, train_iters=10000, save=ckpt, save_interval=2,
                            seq_length=32, metrics_file=tmp_path / "killed.jsonl", **ASYNC,
                            **flags))
    lines = []
    read_until(proc, lambda l: l.startswith(f"saved checkpoint {iteration_dir(str(ckpt), 2)} "
                                             "(written in the background"), lines, "save 2")
    writer = _writer(proc.pid)
    os.kill(writer, signal.SIGSTOP)
    # training goes on to step 6, whose save waits for 4's
    read_until(proc, lambda l: step_of(l) >= 6, lines, "step 6")
    [partial] = [n for n in os.listdir(ckpt) if n.startswith("iter_0000004.partial-")]
    return proc, lines, ckpt, writer, ckpt / partial


def test_a_killed_async_save_leaves_only_its_partial_and_the_next_run_resumes(demo_data, tmp_path):
    proc, lines, ckpt, _, partial = _stalled_save(demo_data, tmp_path)
    # iteration 4's save call returned before its shards exist, and nothing marks it
    assert any(l.startswith(f"saving checkpoint {iteration_dir(str(ckpt), 4)} in the background")
               for l in lines)
    assert not [n for n in os.listdir(partial) if n.endswith(".distcp")]
    assert open(ckpt / TRACKER).read() == "2"
    children = _children(proc.pid)
    assert {"ckpt-writer", "ckpt-results"} <= set(children.values()), children
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.time() + 30
    while not all(map(_gone, children)) and time.time() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, children)), children  # the writer and the rest die with the trainer
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith("jreg_")) == \
        sorted(["iter_0000002", partial.name, TRACKER])
    killed = read_metrics(tmp_path / "killed.jsonl")
    # the next run removes the partial, resumes 2, and a SIGTERM finishes its own save
    resumed = start_trainer(base_args(demo_data, train_iters=10000, save=ckpt, load=ckpt,
                                      save_interval=2,
                               seq_length=32, metrics_file=tmp_path / "resumed.jsonl", **ASYNC))
    lines = []
    read_until(resumed, lambda l: step_of(l) >= 5, lines, "step 5")
    resumed.send_signal(signal.SIGTERM)
    rest, _ = resumed.communicate(timeout=300)
    text = "".join(lines) + rest
    assert resumed.returncode == 0, text[-3000:]
    assert f"removed 1 unfinished save(s) of earlier runs: {partial.name}" in text
    assert f"loaded checkpoint {ckpt} iteration 2" in text
    saved = int(open(ckpt / TRACKER).read())
    assert f"signal received: saving at iteration {saved}" in text
    assert os.path.exists(os.path.join(iteration_dir(str(ckpt), saved), COMPLETE))
    assert not [n for n in os.listdir(ckpt) if ".partial" in n]
    again = read_metrics(tmp_path / "resumed.jsonl")
    assert again[0]["iteration"] == 3
    for got, want in zip(again, killed[2:5]):
        assert (got["iteration"], got["lm_loss"], got["psi"]) == \
            (want["iteration"], want["lm_loss"], want["psi"])


@pytest.mark.parametrize("failure", ["write", "writer", "lock"])
def test_a_failed_background_write_stops_the_run_in_one_line(demo_data, tmp_path, failure):
    """The save's directory removed under the stopped writer (its files cannot be
    written), the writer killed, or --save's lock taken over by another run meanwhile: the
    next step's finalize names it; iteration 4 is not marked and iteration 2 stays the
    newest."""
    proc, lines, ckpt, writer, partial = _stalled_save(demo_data, tmp_path)
    if failure == "lock":
        import json

        lock = ckpt / "jreg_writer.lock"
        lock.with_suffix(".new").write_text(json.dumps(
            dict(json.load(open(lock)), host="node-c", pid=99, run_id="99-other")))
        os.replace(lock.with_suffix(".new"), lock)
        os.kill(writer, signal.SIGCONT)
        rest, _ = proc.communicate(timeout=300)
        assert proc.returncode == 2, rest[-3000:]
        assert rest.strip().splitlines()[-1] == (
            f"error: --save {ckpt}: this run no longer holds {lock} (another run took it over "
            "after this run's heartbeat lapsed, or the file was removed); stopping without "
            "saving so that two runs never write one directory")
        assert open(ckpt / TRACKER).read() == "2"
        assert not os.path.exists(iteration_dir(str(ckpt), 4))
        # its own unfinished directory does not stay in the other run's --save
        assert not [n for n in os.listdir(ckpt) if ".partial" in n], os.listdir(ckpt)
        return
    if failure == "write":
        import shutil

        shutil.rmtree(partial)
        os.kill(writer, signal.SIGCONT)
    else:
        os.kill(writer, signal.SIGKILL)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, rest[-3000:]
    last = rest.strip().splitlines()[-1]
    assert last.startswith(
        f"error: the background save of {iteration_dir(str(ckpt), 4)} failed ("), last
    assert last.endswith(f"it was not marked whole: {partial.name} is removed by the next run on "
                         "that --save, whose newest whole checkpoint is iteration 2"), last
    why = ("rank 0: RuntimeError: Worker failure: [Errno 2] No such file or directory"
           if failure == "write" else
           "this rank's writer process ended (killed by SIGKILL) before it wrote its files")
    assert why in last, last
    assert "Traceback" not in rest
    assert open(ckpt / TRACKER).read() == "2"
    assert not os.path.exists(iteration_dir(str(ckpt), 4))


def test_formats_bench_runs_as_documented_at_a_small_size(tmp_path):
    """bench/checkpoint_formats.py's small documented command: a row per save kind and
    format (its loads checked against the saved weights), the ratios against the plain
    save, the overlap line, and nothing left behind."""
    cmd = "python bench/checkpoint_formats.py --preset tiny --vocab 512 --seq 64"
    doc = open(os.path.join(REPO, "bench", "checkpoint_formats.py")).read()
    assert cmd in doc
    proc = subprocess.run([sys.executable, *cmd.split()[1:], "--dir", str(tmp_path)], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["ranks"] == 2 and len(result["rows"]) == 6
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 7  # the header and a row each
    for r in result["rows"]:
        assert r["whole_s"] >= r["blocked_s"] > 0 and r["load_s"] > 0 and r["bytes"] > 1e6
        line = f"| {r['save']} | {r['format']} | {r['blocked_s']:.2f} | {r['whole_s']:.2f} |"
        assert any(row.startswith(line) for row in table), line
    plain = [row for row in table if row.startswith("| plain |")]
    assert len(plain) == 2 and all(row.endswith("| 1.00x | 1.00x | 1.00x |") for row in plain)
    assert "async, once per run: the results queue's process started in" in proc.stdout
    assert os.listdir(tmp_path) == []
