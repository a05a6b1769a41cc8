"""megatron-core's forked checkpoint writers under platform/checkpoint_writers.py, called
here as a save calls them (``FileSystemWriterAsync.write_preloaded_data_multiproc``, which
forks one writer per file):

- an exception while the writers write (Ctrl-C without the trainer's signal handler) kills
  and reaps them: before, a writer blocked on its file stayed, and multiprocessing's exit
  handler waited for it;
- a writer's OS error names the file it wrote, which its own error did not;
- the fix is among those every model build applies.

That a writer dies with a SIGKILLed trainer is tests/training/test_killed_save_processes.py.
"""

import errno
import io
import os
import queue
import resource
import signal

import pytest

from megatron_jreg.platform import checkpoint_writers, mcore_fixes


@pytest.fixture(scope="module")
def writer():
    checkpoint_writers.fix_writers_die_with_parent()
    checkpoint_writers.fix_writers_die_with_parent()  # idempotent: wrapped once
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    def write(path, data: bytes):
        """Write ``data`` to file ``path`` the way a save writes a shard; the writers'
        result (a list of WriteResults per writer, or the error)."""
        item = WriteItem(index=MetadataIndex("blob"), type=WriteItemType.BYTE_IO)
        bucket = (str(path), os.path.basename(path), ([(item, io.BytesIO(data))], []))
        results = queue.Queue()
        FileSystemWriterAsync.write_preloaded_data_multiproc(
            [_StorageWriterTransforms()], False, 0, [bucket], results)
        return results.get_nowait()

    return write


def _children():
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
        except OSError:  # a thread (a queue's feeder) that ended meanwhile
            continue
    return found


def test_an_exception_while_writers_write_kills_and_reaps_them(writer, tmp_path):
    fifo = tmp_path / "__0_0.distcp"
    os.mkfifo(fifo)  # the writer's open blocks until a reader comes: none will
    caught = []
    before = set(_children())  # this process's other children (a pytest-xdist worker's)

    def interrupt(signum, frame):
        caught.extend(set(_children()) - before)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            writer(fifo, b"x")
        assert caught, "no writer was running"
        assert not set(caught) & set(_children()), caught  # killed, and reaped: no zombie
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for pid in set(caught) & set(_children()):  # the code before the fix left it
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_writers_os_error_names_its_file(writer, tmp_path):
    shard = tmp_path / "__0_0.distcp"
    assert isinstance(writer(shard, b"x" * 1000), dict)  # {writer: its WriteResults}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, hard))  # the forked writer inherits it
    try:
        failed = writer(shard, b"x" * 100_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert isinstance(failed, OSError), repr(failed)
    assert (failed.errno, failed.filename) == (errno.EFBIG, str(shard))


def test_every_save_gets_the_fix():
    assert checkpoint_writers.fix_writers_die_with_parent in mcore_fixes.FIXES
