"""One writer per output for convert_to_hf, eval_jump and eval_downstream (reports and cache
entries); SIGTERM removes their temporary exports; exported files get the umask's mode;
the downstream cache follows the tokenizer files.

A live writer is the test process holding the output's lock; a kill lands while a driver
script holds the tool inside its work (a patched call that marks a file and sleeps), so
nothing depends on timing."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from checkpoint_runs import REPO, run_env

import forked_trainer
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import lock_path, output_lock

transformers = pytest.importorskip("transformers")


def env(**extra):
    return dict(run_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO,
                TOKENIZERS_PARALLELISM="false", **extra)


def run_tool(script, argv, **extra):
    return forked_trainer.run_tool(f"tools/{script}", argv, env(**extra), timeout=600)


def busy(proc, flag, path):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, lines
    assert f"{flag} {path}: another process" in lines[0] and "is writing it" in lines[0], lines


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One tiny run of the trainer (3 steps, byte tokenizer)."""
    from checkpoint_runs import make_dataset, train

    from session_cache import build_once

    def build(root):
        return train(make_dataset(str(root)), str(root / "ckpt"))

    return build_once(tmp_path_factory, "one_writer_checkpoint", build)


DRIVER = """
import importlib, os, sys, time
sys.path.insert(0, {repo!r})
module, attr, marker = sys.argv[1:4]

def held(*args, **kwargs):
    out = real(*args, **kwargs) if {call_real} else None
    open(marker, "w").close()
    time.sleep(600)
    return out

if __name__ == "__main__":  # not in a spawned child, which imports this file again
    owner = importlib.import_module(module.split(":")[0])
    for part in module.split(":")[1:]:
        owner = getattr(owner, part)
    real = getattr(owner, attr)
    setattr(owner, attr, held)
    tool = importlib.import_module(sys.argv[4])
    sys.exit(tool.main(sys.argv[5:]))
"""


def killed_while_held(tmp_path, target, tool_module, argv, call_real=True, **extra):
    """Run ``tool_module.main(argv)`` with ``target`` (``module[:Class], attr``) replaced by
    a call that marks a file and sleeps; SIGTERM once marked. Returns its exit status and
    output."""
    marker = tmp_path / "held"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=REPO, call_real=call_real))
    proc = subprocess.Popen([sys.executable, str(script), *target, str(marker), tool_module,
                             *map(str, argv)], cwd=REPO, env=env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    return SimpleNamespace(returncode=proc.returncode, stdout=stdout, stderr=stderr)


# ---- convert_to_hf --------------------------------------------------------------------------


def test_convert_to_hf_refused_while_another_writes_the_output(checkpoint, tmp_path):
    out = tmp_path / "hf"
    with output_lock(str(out), "--output"):
        proc = run_tool("convert_to_hf.py", ["--load", checkpoint, "--output", out])
        busy(proc, "--output", out)
        assert os.listdir(tmp_path) == [os.path.basename(lock_path(str(out)))]  # the holder's


def test_convert_to_hf_sigterm_removes_the_temporary_export(checkpoint, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "hf"
    proc = killed_while_held(work, ["transformers:PreTrainedModel", "save_pretrained"],
                             "megatron_jreg.commands.convert_to_hf",
                             ["--load", checkpoint, "--output", out])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "stopped (SIGTERM)" in lines[-1] and "temporary files removed" in lines[-1], lines
    assert sorted(os.listdir(tmp_path)) == ["work"]  # no export, no .hf.* temp, no lock


def test_convert_to_hf_files_get_the_umask_mode(checkpoint, tmp_path):
    old = os.umask(0o022)
    try:  # a process started here, which inherits this umask (a forked one has its server's)
        proc = subprocess.run([sys.executable, "tools/convert_to_hf.py", "--load", checkpoint,
                               "--output", tmp_path / "hf"], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=600)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stat.S_IMODE(os.stat(tmp_path / "hf").st_mode) == 0o755
    modes = {name: stat.S_IMODE(os.stat(tmp_path / "hf" / name).st_mode)
             for name in os.listdir(tmp_path / "hf")}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# ---- eval_jump ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_eval_jump_refused_while_another_writes_a_report(tiny_hf_model, eval_text, tmp_path, flag):
    out = tmp_path / f"r.{ {'--json': 'json', '--csv': 'csv', '--plot': 'png'}[flag] }"
    argv = ["--hf-model", tiny_hf_model, "--text-file", eval_text, "--seq-length", "16",
            flag, out]
    with output_lock(str(out), flag):
        proc = run_tool("eval_jump.py", argv)
        busy(proc, flag, out)
        assert proc.stdout == ""  # refused before any model loads
    assert not out.exists()


# ---- eval_downstream ------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--csv"])
def test_eval_downstream_refused_while_another_writes_a_report(tiny_hf_model, tmp_path, flag):
    pytest.importorskip("lm_eval")
    out = tmp_path / f"r.{flag[2:]}"
    with output_lock(str(out), flag):
        proc = run_tool("eval_downstream.py", ["--hf-model", tiny_hf_model, "--tasks", "sciq",
                                               "--no-cache", flag, out])
        busy(proc, flag, out)
    assert not out.exists()


def test_eval_downstream_cache_entry_has_one_writer(tiny_hf_model, tmp_path, monkeypatch):
    from megatron_jreg.downstream import cache as cache_mod
    from megatron_jreg.downstream import evaluate as cli
    from megatron_jreg.downstream import harness

    started, release, calls, out = threading.Event(), threading.Event(), [], []

    def evaluate_hf(model_dir, names, manager, **run):
        calls.append(list(names))
        if len(calls) == 1:  # the first run stays inside its evaluation
            started.set()
            release.wait(120)
        return {t: {"metrics": {"acc,none": 0.5}, "samples": 3} for t in names}

    monkeypatch.setattr(harness, "evaluate_hf", evaluate_hf)
    cache = cache_mod.ResultCache(str(tmp_path / "cache"))
    entry = cli.ModelEntry("tiny", "hf_model", tiny_hf_model, local=tiny_hf_model,
                           identity=cache_mod.hf_model_identity(tiny_hf_model))
    args = SimpleNamespace(num_fewshot=0, dtype="float32", device="cpu", batch_size="1",
                           device_map=None)

    def evaluate():
        return cli.evaluate_model(entry, ["t"], {"t": "digest"}, None, cache, args, None)

    first = threading.Thread(target=lambda: out.append(evaluate()))
    first.start()
    try:
        assert started.wait(120)
        with pytest.raises(InputError, match="--cache-dir entry of tiny/t: .*another process"):
            evaluate()
    finally:
        release.set()
        first.join()
    assert calls == [["t"]] and out[0]["t"]["samples"] == 3
    assert evaluate()["t"]["samples"] == 3 and calls == [["t"]]  # read from the cache
    assert not [n for n in os.listdir(tmp_path / "cache") if n.endswith(".lock")]


def test_eval_downstream_sigterm_removes_the_temporary_export(checkpoint, tmp_path):
    pytest.importorskip("lm_eval")
    from downstream_tasks import LAMBADA, write_tasks

    tasks = write_tasks(str(tmp_path / "tasks"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    proc = killed_while_held(
        work, ["megatron_jreg.downstream.harness", "evaluate_hf"],
        "megatron_jreg.commands.eval_downstream",
        ["--load", checkpoint, "--tasks", LAMBADA, "--include-path", tasks, "--no-cache",
         "--json", tmp_path / "r.json"], call_real=False, TMPDIR=str(tmp),
        HF_HOME=str(tmp_path / "hf_home"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "stopped (SIGTERM)" in lines[-1] and "temporary files removed" in lines[-1], lines
    # the export under TMPDIR is gone (torch keeps its own compile cache there)
    assert [n for n in os.listdir(tmp) if n.startswith("eval_downstream")] == []
    assert not (tmp_path / "r.json").exists() and not os.path.exists(
        lock_path(str(tmp_path / "r.json")))


# ---- the downstream cache key ----------------------------------------------------------------


def test_cache_key_follows_the_tokenizer_files(tiny_hf_model, tmp_path):
    from megatron_jreg.downstream.cache import checkpoint_identity, hf_model_identity

    model = tmp_path / "model"
    shutil.copytree(tiny_hf_model, model)
    before = hf_model_identity(str(model))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 7  # same weights and config.json, another tokenizer
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert hf_model_identity(str(model)) != before

    # a checkpoint's run config names its tokenizer file, which lives outside it
    sp = tmp_path / "tok.model"
    sp.write_bytes(b"first tokenizer")
    data = SimpleNamespace(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(sp))
    it_dir = tmp_path / "iter"
    it_dir.mkdir()
    before = checkpoint_identity(str(it_dir), str(tmp_path), 1, data)
    sp.write_bytes(b"retrained tokenizer")
    assert checkpoint_identity(str(it_dir), str(tmp_path), 1, data) != before


# ---- a SIGKILLed conversion: the next run takes over, warns and removes its staging ---------


def sigkilled_while_held(tmp_path, target, tool_module, argv, **extra):
    """``killed_while_held`` with SIGKILL: no handler runs, the staging directory stays."""
    marker = tmp_path / "held"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=REPO, call_real=True))
    proc = subprocess.Popen([sys.executable, str(script), *target, str(marker), tool_module,
                             *map(str, argv)], cwd=REPO, env=env(**extra),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate()


def taken_over(proc, flag, path, leftovers):
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert warnings[0].startswith(f"warning: {flag} {path}: took over the lock of pid "), warnings
    assert "no process holds its lock file any more (it ended)" in warnings[0], warnings
    assert leftovers and all(name in warnings[0] for name in leftovers), (leftovers, warnings)


def test_convert_to_hf_after_a_sigkill_removes_the_dead_runs_export(checkpoint, tmp_path):
    work, out = tmp_path / "work", tmp_path / "hf"
    work.mkdir()
    sigkilled_while_held(work, ["transformers:PreTrainedModel", "save_pretrained"],
                         "megatron_jreg.commands.convert_to_hf",
                         ["--load", checkpoint, "--output", out])
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".hf.") and ".lock" not in n]
    proc = run_tool("convert_to_hf.py", ["--load", checkpoint, "--output", out])
    taken_over(proc, "--output", out, leftovers)
    assert sorted(os.listdir(tmp_path)) == ["hf", "work"]


def test_convert_from_hf_refused_while_another_writes_the_save(tiny_hf_model, tmp_path):
    save = tmp_path / "ckpt"
    with output_lock(str(save), "--save"):
        proc = run_tool("convert_from_hf.py", ["--hf-model", tiny_hf_model, "--save", save])
        busy(proc, "--save", save)
        assert os.listdir(tmp_path) == [os.path.basename(lock_path(str(save)))]  # the holder's


def test_convert_from_hf_after_a_sigkill_removes_the_dead_runs_staging(tiny_hf_model, tmp_path):
    work, save = tmp_path / "work", tmp_path / "ckpt"
    work.mkdir()
    sigkilled_while_held(work, ["megatron_jreg.checkpoint.dist_checkpoint", "save_checkpoint"],
                         "megatron_jreg.commands.convert_from_hf",
                         ["--hf-model", tiny_hf_model, "--save", save])
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".ckpt.") and ".lock" not in n]
    proc = run_tool("convert_from_hf.py", ["--hf-model", tiny_hf_model, "--save", save])
    taken_over(proc, "--save", save, leftovers)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "work"]
