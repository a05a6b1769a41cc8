"""A SIGKILLed preprocessing run takes its workers and partition processes with it.

SIGKILL cannot be caught, so the parent cannot stop its children itself: before the fix its
pool workers waited forever for work and partition processes ran to the end of their input,
writing into a temp directory nobody would remove.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

psutil = pytest.importorskip("psutil")

from preprocess_helpers import make_documents, write_jsonl  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def _alive(procs):
    """Processes still running; a zombie has exited (only its reaper is late)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(procs, timeout):
    deadline = time.monotonic() + timeout
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(procs)


def _kill_all(procs):
    for p in _alive(procs):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """Enough text that a run with tiny chunks lasts far longer than the test waits."""
    path = tmp_path_factory.mktemp("orphans") / "big.jsonl"
    docs = [{"text": t} for t in make_documents(4000, seed=7)]
    write_jsonl(path, docs * 16)
    return str(path)


@pytest.mark.parametrize("partitions, expected_children", [(1, 2), (2, 4)])
def test_sigkill_of_the_parent_kills_its_children(tmp_path, big_corpus, partitions,
                                                  expected_children):
    # partitions=2: two partition processes, each with one pool worker of its own.
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", big_corpus, "--output-prefix",
           str(tmp_path / "out"), "--tokenizer-type", "ByteTokenizer", "--append-eod",
           "--workers", "2", "--partitions", str(partitions), "--chunk-bytes", "512",
           "--log-interval", "100000000"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    children = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            children = parent.children(recursive=True)
            if len(_alive(children)) >= expected_children:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before its workers could be seen"
        assert len(children) >= expected_children, children
        time.sleep(0.3)  # let the workers get busy (and finish their initializers)
        children = parent.children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        survivors = _wait_gone(children, timeout=5)
        assert survivors == [], [(p.pid, p.name()) for p in survivors]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(children)


def test_fallback_watch_without_prctl_ends_an_orphan(tmp_path):
    # Where prctl is missing (macOS), a thread in the child polls its parent instead.
    script = textwrap.dedent("""
        import os, sys, time
        from megatron_jreg.data.preprocess import parent_death
        parent_death._set_parent_death_signal = lambda: False
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            parent_death.die_with_parent(parent_pid)
            time.sleep(60)
            os._exit(0)
        print(pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        time.sleep(0.3)
        assert _alive([child]) == [child]
        proc.kill()
        proc.wait()
        assert _wait_gone([child], timeout=5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            _kill_all([child])
