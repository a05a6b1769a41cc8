"""megatron-core's checkpoint writer processes end with the process that forked them.

megatron-core 0.16.1 forks one writer process per file for every torch_dist save
(``dist_checkpointing/strategies/filesystem_async.py:266``); a trainer killed mid-save left
them blocked for ever. :func:`fix_writers_die_with_parent` (one of ``mcore_fixes.FIXES``)
makes each writer die with its parent, reaps them when the wait fails, and names the file
a failed write was writing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import sys
from typing import Optional

from megatron_jreg.errors import os_write_error, write_error_at

WRITER_NAME = b"ckpt-file"  # what ps and top show for each forked writer (/proc/PID/comm)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15  # <linux/prctl.h>

# The process that forks the writers; set before the fork, so each writer reads its parent
# here (os.getppid() after the fork could already be init's).
_forked_by: Optional[int] = None


def die_with(parent: int, name: bytes = WRITER_NAME) -> None:
    """SIGKILL this process when ``parent`` (the process that forked it) dies, on Linux, and
    name it; exit now when ``parent`` died already."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


def named_failure(err: BaseException, path: str) -> BaseException:
    """``err`` of a write of ``path`` as an OSError naming the file when an OS error of
    ``errors.WRITE_ERRNOS`` is behind it (given, or told by what the write left)."""
    found = os_write_error(err)
    if found is not None:
        code, name = found
        return OSError(code, os.strerror(code), name or path)
    return write_error_at(path) or err


def _not_a_repeated_failure(record) -> bool:
    return not (record.getMessage().startswith("Local process ")
                and " encountered an error: " in record.getMessage())


class _NamingQueue:
    """A writer's results queue whose failures name the file (:func:`named_failure`)."""

    def __init__(self, queue, path: str):
        self.queue, self.path = queue, path

    def put(self, item) -> None:
        index, result = item
        if isinstance(result, BaseException):
            result = named_failure(result, self.path)
        self.queue.put((index, result))


def fix_writers_die_with_parent() -> None:
    """Wrap megatron-core's writer fork and writer body (class attributes: megatron-core
    reads them at each save, ``partial(FileSystemWriterAsync.write_preloaded_data, ...)``)
    and the save of ``common.pt``; idempotent.

    - each forked writer asks Linux to SIGKILL it when the process that forked it dies
      (``PR_SET_PDEATHSIG``; also for ``--async-save``, whose worker process forks them), and
      exits at once if that process died before it asked (the signal follows the forking
      thread: both fork from their main thread, which lives as long as the process);
    - an exception out of the wait (Ctrl-C without the signal handler) kills and reaps the
      writers before it goes on, instead of leaving them to multiprocessing's exit handler,
      which waits for them;
    - a writer's failure names the file it was writing and keeps its OS error number
      (``errors.write_error_at``, where torch's zip writer lost it: "unexpected pos"), so a
      full disk or the file size limit is one line naming the file; megatron-core's own log
      line about it (line 323, "Local process N encountered an error") is dropped.
      ``common.pt``, written by the saving process with ``torch.save``
      (``strategies/common.py:48``), fails the same way, named the same way."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.common import (
        COMMON_STATE_FNAME,
        TorchCommonSaveStrategy,
    )
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync as writer,
    )

    if getattr(writer.write_preloaded_data, "_megatron_jreg_fix", False):
        return
    fork_writers = writer.write_preloaded_data_multiproc  # the functions under staticmethod
    write_file = writer.write_preloaded_data

    # wraps: an --async-save request carries the function to its worker process by its
    # megatron-core name, which finds the wrapper there too (the worker applies this fix)
    @functools.wraps(fork_writers)
    def write_preloaded_data_multiproc(*args, **kwargs):
        global _forked_by
        _forked_by = os.getpid()
        before = set(multiprocessing.active_children())
        try:
            return fork_writers(*args, **kwargs)
        except BaseException:
            for child in set(multiprocessing.active_children()) - before:
                child.kill()
                child.join()
            raise

    @functools.wraps(write_file)
    def write_preloaded_data(transform_list, *args, **kwargs):
        # megatron-core passes everything but transform_list by keyword (line 274)
        if _forked_by is not None:
            die_with(_forked_by)
        kwargs["results_queue"] = _NamingQueue(kwargs["results_queue"],
                                               kwargs["write_bucket"][0])
        return write_file(transform_list, *args, **kwargs)

    common_strategy = TorchCommonSaveStrategy
    save_common = common_strategy.save_common

    @functools.wraps(save_common)
    def save_common_named(self, common_state_dict, checkpoint_dir):
        try:
            return save_common(self, common_state_dict, checkpoint_dir)
        except Exception as err:
            failure = named_failure(err, os.path.join(checkpoint_dir, COMMON_STATE_FNAME))
            if failure is err:
                raise
            raise failure from err

    common_strategy.save_common = save_common_named
    logging.getLogger(filesystem_async.__name__).addFilter(_not_a_repeated_failure)
    write_preloaded_data._megatron_jreg_fix = True
    writer.write_preloaded_data_multiproc = staticmethod(write_preloaded_data_multiproc)
    writer.write_preloaded_data = staticmethod(write_preloaded_data)
