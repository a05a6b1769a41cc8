"""One writer per output for the data tools, an existing output kept without --overwrite,
and the mode of atomically written files.

Concurrency is made deterministic by holding an output's lock from the test process (a
live writer) while the tool runs: the tool must be refused in one line, exit 2, and leave
the holder's lock and files alone."""

import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from megatron_jreg.atomic_write import write_text_atomic
from megatron_jreg.checkpoint.save_lock import SaveLock
from megatron_jreg.writer_lock import OutputBusy, lock_path, output_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tool(script, *argv):
    return subprocess.run([sys.executable, f"tools/{script}", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def one_line(proc, *parts):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, lines
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stale_lock(output):
    """The lock file a SIGKILLed writer of ``output`` leaves behind."""
    with open(lock_path(str(output)), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": dead_pid(), "start_time": "then",
                   "run_id": "gone"}, f)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("one_writer") / "c.jsonl"
    assert tool("make_demo_corpus.py", "--output", path, "--max-docs", "300").returncode == 0
    return path


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("one_writer_chat") / "chat.jsonl"
    assert tool("make_demo_corpus.py", "--chat", "--output", path, "--max-docs",
                "30").returncode == 0
    return path


# ---- modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_atomic_writes_get_the_mode_open_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_text_atomic(str(tmp_path / "a.json"), "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o666 & ~umask


def test_sft_metadata_gets_the_mode_open_gives(chat, tmp_path, umask_022):
    prefix = tmp_path / "sft"
    proc = tool("preprocess_data.py", "--sft", "--input", chat, "--output-prefix", prefix,
                "--tokenizer-type", "ByteTokenizer")
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = [p for p in os.listdir(tmp_path) if p.startswith("sft")]
    assert any(p.endswith(".json") for p in written), written
    for name in written:
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


# ---- preprocess_data: one writer per --output-prefix ----------------------------------------


@pytest.mark.parametrize("sft", [False, True])
def test_preprocess_refused_while_another_run_writes_the_prefix(corpus, chat, tmp_path, sft):
    prefix = tmp_path / "out"
    argv = (["--sft", "--input", chat] if sft else ["--input", corpus, "--append-eod"])
    argv += ["--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer", "--overwrite"]
    with output_lock(str(prefix), "--output-prefix"):  # a live writer of the same prefix
        proc = tool("preprocess_data.py", *argv)
        one_line(proc, f"--output-prefix {prefix}", "another process", "is writing it")
        assert os.path.exists(lock_path(str(prefix)))  # the holder's lock stays
    assert sorted(os.listdir(tmp_path)) == []  # nothing of the refused run
    proc = tool("preprocess_data.py", *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not os.path.exists(lock_path(str(prefix)))  # released: no junk left behind
    assert not any(name.endswith(".lock") for name in os.listdir(tmp_path))


def test_stale_lock_of_a_killed_run_does_not_block(corpus, tmp_path):
    prefix = tmp_path / "out"
    stale_lock(prefix)
    proc = tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
                "--tokenizer-type", "ByteTokenizer")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["out_text_document.bin", "out_text_document.idx"]


# ---- make_demo_corpus and train_tokenizer: no silent replacement, one writer ----------------


def test_make_demo_corpus_keeps_an_existing_corpus(tmp_path):
    out = tmp_path / "c.jsonl"
    out.write_text("mine\n")
    proc = tool("make_demo_corpus.py", "--output", out, "--max-docs", "5")
    one_line(proc, str(out), "--overwrite", "already exists")
    assert out.read_text() == "mine\n" and proc.stdout == ""
    proc = tool("make_demo_corpus.py", "--output", out, "--max-docs", "5", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 5
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_make_demo_corpus_refused_while_another_writes(tmp_path):
    out = tmp_path / "c.jsonl"
    with output_lock(str(out), "--output"):
        proc = tool("make_demo_corpus.py", "--output", out, "--max-docs", "5")
        one_line(proc, f"--output {out}", "another process")
    assert not out.exists()


def test_train_tokenizer_keeps_an_existing_model(corpus, tmp_path):
    prefix = tmp_path / "sp"
    (tmp_path / "sp.model").write_bytes(b"old model")
    argv = ["--input", corpus, "--model-prefix", prefix, "--vocab-size", "1000"]
    proc = tool("train_tokenizer.py", *argv)
    one_line(proc, f"{prefix}.model", "--overwrite", "already exists")
    assert (tmp_path / "sp.model").read_bytes() == b"old model"
    proc = tool("train_tokenizer.py", *argv, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "sp.model").read_bytes() != b"old model"
    assert sorted(os.listdir(tmp_path)) == ["sp.model", "sp.vocab"]


def test_train_tokenizer_refused_while_another_writes(corpus, tmp_path, umask_022):
    prefix = tmp_path / "sp"
    argv = ["--input", corpus, "--model-prefix", prefix, "--vocab-size", "1000"]
    with output_lock(str(prefix), "--model-prefix"):
        one_line(tool("train_tokenizer.py", *argv), f"--model-prefix {prefix}", "another process")
    assert os.listdir(tmp_path) == []
    assert tool("train_tokenizer.py", *argv).returncode == 0
    for name in ("sp.model", "sp.vocab"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644


# ---- the lock itself, and the trainer's --save lock that shares it ---------------------------


def test_output_lock_in_one_process_and_after_a_kill(tmp_path):
    out = str(tmp_path / "r.json")
    with output_lock(out, "--json"):
        with pytest.raises(OutputBusy, match=f"--json {out}: another process"):
            with output_lock(out, "--json"):
                pass
    assert os.listdir(tmp_path) == []
    stale_lock(out)
    with output_lock(out, "--json"):
        pass
    assert os.listdir(tmp_path) == []


def test_save_lock_shares_the_writer_lock(tmp_path):
    first, second = SaveLock(str(tmp_path)), SaveLock(str(tmp_path))
    assert first.acquire() is None
    with pytest.raises(ValueError, match=f"--save {tmp_path} is in use by pid {os.getpid()}"):
        second.acquire()
    first.release()
    assert os.listdir(tmp_path) == []
    with open(tmp_path / "jreg_writer.lock", "w") as f:
        json.dump({"host": socket.gethostname(), "pid": dead_pid(), "start_time": "then"}, f)
    warning = second.acquire()
    assert warning.startswith("warning: took over the lock of pid ") and str(tmp_path) in warning
    assert "its process is no longer running" in warning
    second.release()
    assert os.listdir(tmp_path) == []


# ---- a SIGKILLed writer: the takeover warns and removes exactly its temporaries -------------


def test_takeover_removes_only_the_dead_writers_temporaries(tmp_path, capsys):
    from megatron_jreg.atomic_write import writer_tag

    out, tag = tmp_path / "out", f"{dead_pid()}-0badf00d"
    with open(lock_path(str(out)), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": int(tag.split("-")[0]),
                   "start_time": "then", "run_id": "gone", "temp_tag": tag}, f)
    dead = [f"out_text_document.bin.tmp-{tag}", f"out_text_document.tmp-{tag}.lengths"]
    kept = [f"out_text_document.bin.tmp-{writer_tag()}",  # a live writer's (this process)
            f"other.tmp-{tag}", "out_text_document.bin"]  # another output's; a finished one
    for name in dead + kept:
        (tmp_path / name).write_text("x")
    (tmp_path / f".out.tmp-{tag}.abc123").mkdir()  # a staging directory (temp_dir_beside)
    (tmp_path / f".out.tmp-{tag}.abc123" / "model.safetensors").write_text("x")
    with output_lock(str(out), "--output-prefix"):
        pass
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: --output-prefix {out}: took "
                                                       f"over the lock of pid {tag.split('-')[0]} "
                                                       "on host "
                                                       f"{socket.gethostname()}, started then: its "
                                                       "process is no longer running"), warning
    for name in dead + [f".out.tmp-{tag}.abc123"]:
        assert name in warning[0]
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


KILL_DRIVER = """
import sys, time
sys.path.insert(0, {repo!r})
marker = sys.argv[1]
if __name__ == "__main__":  # not in a spawned worker, which imports this file again
    from megatron_jreg.data.preprocess import writer as indexed_writer
    from megatron_jreg.commands import preprocess

    def held(self):  # the .bin and spill temporaries are written; the rename never comes
        open(marker, "w").close()
        time.sleep(600)

    indexed_writer.IndexedDatasetOutput.commit = held
    sys.exit(preprocess.main(sys.argv[2:]))
"""


def test_preprocess_sigkill_leftovers_are_removed_by_the_next_run(corpus, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "driver.py").write_text(KILL_DRIVER.format(repo=REPO))
    argv = ["--input", corpus, "--output-prefix", out, "--tokenizer-type", "ByteTokenizer"]
    proc = subprocess.Popen([sys.executable, str(work / "driver.py"), str(work / "held"),
                             *map(str, argv)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (work / "held").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no cleanup runs
        proc.communicate()
    left = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert any(n.endswith(".lengths") for n in left) and any(".bin.tmp-" in n for n in left), left
    rerun = tool("preprocess_data.py", *argv)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    warnings = [line for line in rerun.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert "no process holds its lock file any more (it ended)" in warnings[0], warnings
    assert all(name in warnings[0] for name in left), (left, warnings)
    assert sorted(os.listdir(tmp_path)) == ["out_text_document.bin", "out_text_document.idx",
                                            "work"]


# ---- flag ranges: refused in one line before any work --------------------------------------


@pytest.mark.parametrize("value", [0, -5, 1, 100])
def test_train_tokenizer_max_sentences_out_of_range(corpus, tmp_path, value):
    # sentencepiece takes 0 as "every line" and stops on 1-100 with an internal check.
    proc = tool("train_tokenizer.py", "--input", corpus, "--model-prefix", tmp_path / "sp",
                "--max-sentences", value)
    one_line(proc, "--max-sentences", ">= 101", f"got {value}")
    assert os.listdir(tmp_path) == []


def test_train_tokenizer_too_few_sentences_for_the_vocabulary_names_the_flag(corpus, tmp_path):
    proc = tool("train_tokenizer.py", "--input", corpus, "--model-prefix", tmp_path / "sp",
                "--max-sentences", 101, "--vocab-size", 3000)
    one_line(proc, "--vocab-size 3000", "--max-sentences 101")
    assert os.listdir(tmp_path) == []


def test_make_demo_corpus_refuses_writing_no_documents(tmp_path):
    out = tmp_path / "x.jsonl"
    proc = tool("make_demo_corpus.py", "--output", out, "--skip-docs", 100000000, "--max-docs", 5)
    one_line(proc, "--skip-docs 100000000", "no documents")
    assert os.listdir(tmp_path) == [] and proc.stdout == ""
