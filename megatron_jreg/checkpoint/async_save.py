"""Checkpoint saves written in the background: Megatron-LM's ``--async-save`` with its
persistent worker (``--use-persistent-ckpt-worker``), on megatron-core's async machinery
(``dist_checkpointing.save(..., async_sharded_save=True)``, ``AsyncCallsQueue``).

``dist_checkpoint.save_checkpoint`` given an :class:`AsyncSaver` blocks only for the state
dict, the save plan and a host copy of this rank's tensors; a worker process per rank writes
the shards; :meth:`AsyncSaver.finalize` (collective, at a later step) completes the save as a
synchronous one is. One save is in flight at a time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from multiprocessing.managers import SyncManager
from queue import Empty
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
)
from torch import multiprocessing as mp

from megatron_jreg.checkpoint import catalog
from megatron_jreg.errors import CheckpointError, write_error_line
from megatron_jreg.platform.checkpoint_writers import fix_writers_die_with_parent

logger = logging.getLogger(__name__)

# what ps and top show for the two processes a run starts (/proc/PID/comm: 15 bytes)
WORKER_NAME, RESULTS_NAME = b"ckpt-writer", b"ckpt-results"


def _die_with(parent: int, name: bytes) -> None:
    """SIGKILL this process when the trainer that started it dies (Linux), so that a killed
    run leaves no writer going on in a directory the next run removes, and no process
    behind; and name it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # no prctl: not Linux
        pass
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(1)


def _worker_main(parent: int, rank: int, queue, preload_q, comp_q, log_level: int) -> None:
    """A worker process: megatron-core's loop, bound to its trainer's life."""
    _die_with(parent, WORKER_NAME)
    # the files are written by processes this one forks (megatron-core's writer): they die
    # with it as the trainer's own do (build_model applied this fix there, not here)
    fix_writers_die_with_parent()
    # The loop starts with torch.cuda.set_device(rank % torch.cuda.device_count()). The
    # requests it gets hold host copies only (no preload_fn), so this process never needs
    # a device: it creates no CUDA context on a GPU machine, and on a machine without a
    # GPU the modulo would divide by zero.
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    PersistentAsyncCaller.async_loop(rank, queue, preload_q, comp_q, log_level)


class _Worker(PersistentAsyncCaller):
    """megatron-core's persistent caller with :func:`_worker_main` as its process, and a
    wait that ends when the process does (megatron-core's polls for ever after a worker
    killed by the kernel's out-of-memory killer)."""

    def __init__(self):
        super().__init__()
        self.ended: Optional[int] = None  # its exit code, when it ended with a save in flight
        self.writing = False  # the save in flight gave this rank something to write

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        self.writing = async_req.async_fn is not None
        if self.process is None and self.writing:
            # started here, before megatron-core's method would start its own loop
            self.process = mp.get_context("spawn").Process(
                target=_worker_main, args=(os.getpid(), dist.get_rank(), self.queue,
                                           self.preload_q, self.comp_q, logger.getEffectiveLevel()))
            self.process.start()
        super().schedule_async_call(async_req)

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if not self.writing and self.cur_item is None:
            # nothing was sent (all of this rank's tensors are written by others): done here;
            # megatron-core's check would wait for a reply a worker started earlier never sends
            self.cur_item = -1
        while self.process is not None and self.cur_item is None:
            try:
                self.cur_item = self.comp_q.get(block=blocking, timeout=0.1 if blocking else None)
            except Empty:
                if not self.process.is_alive():
                    self.ended = self.process.exitcode
                    # "done" without results: the finalize then fails on every rank
                    self.cur_item = -1
                elif not blocking:
                    break
        # this rank's part is known now: megatron-core's check agrees on it with the others
        return super().is_current_async_call_done(False, no_dist)

    def close(self, abort: bool = False) -> None:
        if self.process is not None and (abort or not self.process.is_alive()):
            # ended already, or killed here (megatron-core's abort logs a warning after the
            # run's own line about it): nothing to tell it, nothing to wait for
            self.process.kill()
            self.process.join()
            self.process = None
            # a request it never read stays in the pipe: not flushed at exit (a hang)
            for queue in (self.queue, self.preload_q, self.comp_q):
                queue.cancel_join_thread()
        super().close(abort=abort)

    def __del__(self):
        # megatron-core's calls close(), which asks torch.distributed for the rank: an error
        # printed at exit, once the process group is gone. AsyncSaver.close closed it.
        if self.process is not None and self.process.is_alive():
            self.process.kill()


def _host_copies(request: AsyncRequest) -> AsyncRequest:
    """``request`` writing a copy of each of its tensors in host memory, taken now.

    megatron-core's worker copies device tensors to the host itself before the trainer goes
    on (its ``preload_fn``), but takes host tensors by reference, and the next optimizer
    steps would change them while they are written: on a CPU every tensor is such a tensor
    (megatron-core notes it as a TODO at ``_clone_if_needed``). Copying every tensor here
    gives both devices one path, and the worker needs no device at all."""
    if request.async_fn is None:  # nothing to write on this rank
        return request
    # FileSystemWriterAsync.get_save_function_and_args: (rank, write buckets, results queue)
    rank, buckets, results = request.async_fn_args
    copied = [(path, key, (data, [(item, tensor.detach().to("cpu", copy=True))
                                  for item, tensor in tensors]))
              for path, key, (data, tensors) in buckets]
    return request._replace(async_fn_args=[rank, copied, results], preload_fn=None)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _exit_text(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def failure_detail(err: BaseException) -> str:
    """What failed, in a few words: the first rank's error of megatron-core's
    CheckpointException (rank 0's holds every rank's; the others' hold none), else the
    error itself."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, (exc, _) = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}"
    if failures is not None:
        return "another rank's write failed: rank 0's error names it"
    return f"{type(err).__name__}: {_first_line(err)}"


class PendingSave(NamedTuple):
    path: str  # the iteration directory it becomes
    partial: str  # the directory it is written in
    started: float  # time.time() when it was handed to the worker


class AsyncSaver:
    """The background saves of one run (one object on every rank). The results queue
    starts with :meth:`start` (the trainer's setup, else the save), the worker at the first
    save that gives this rank something to write; :meth:`close` ends them."""

    def __init__(self):
        self.pending: Optional[PendingSave] = None
        self._calls: Optional[AsyncCallsQueue] = None
        self._manager = None
        self._saved_queue = None
        self._failed = False  # a finalize failed: the worker is not told to end, it is killed

    def start(self) -> None:
        """Start the results queue (idempotent): before the save is planned, since the
        writer takes the module-wide queue then. The worker starts at the first save."""
        if self._calls is not None:
            return
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        self._calls = AsyncCallsQueue(persistent=True)
        self._calls.persistent_caller = _Worker()
        # The writer puts each file's result in filesystem_async's module-wide queue, which
        # mcore_fixes makes an in-process one for synchronous saves. Here the writer is
        # another process: megatron-core's own kind of queue, served by a manager process,
        # whose puts return once stored, so the results are in before the worker says done.
        self._manager = SyncManager(ctx=mp.get_context("spawn"))
        self._manager.start(_die_with, (os.getpid(), RESULTS_NAME))
        self._saved_queue = filesystem_async._results_queue
        filesystem_async._results_queue = self._manager.Queue()

    def schedule(self, request: AsyncRequest, path: str, partial: str) -> None:
        """Hand ``request`` (``dist_checkpointing.save(..., async_sharded_save=True)``'s,
        with the functions that complete the save added) to the worker; collective. Returns
        once this rank's host copy is taken."""
        assert self.pending is None, "finalize(blocking=True) the pending save first"
        assert self._calls is not None, "start() before the save is planned"
        self._calls.schedule_async_request(_host_copies(request))
        self.pending = PendingSave(path, partial, time.time())

    def finalize(self, blocking: bool = False) -> Optional[Tuple[str, float]]:
        """Complete the pending save once every rank's worker has written its files
        (``blocking``: wait for them). Collective while a save is pending, nothing
        otherwise. Returns (its directory, seconds since it was scheduled) when it was
        completed now. Raises CheckpointError, the save left unmarked, when it failed."""
        if self.pending is None:
            return None
        from torch.distributed.checkpoint.api import CheckpointException

        pending = self.pending
        try:
            done = self._calls.maybe_finalize_async_calls(blocking=blocking)
        # megatron-core raises torch's CheckpointException (a BaseException) on every rank
        # when a rank's write failed
        except (Exception, CheckpointException) as err:
            self.pending, self._failed = None, True
            if isinstance(err, CheckpointError):  # ours, from a completing function: as it is
                raise
            raise CheckpointError(self._failure(pending, err)) from err
        if not done:
            return None
        self.pending = None
        return pending.path, time.time() - pending.started

    def _failure(self, pending: PendingSave, err: BaseException) -> str:
        ended = self._calls.persistent_caller.ended
        why = (f"this rank's writer process ended ({_exit_text(ended)}) before it wrote its "
               "files" if ended is not None else write_error_line(err) or failure_detail(err))
        whole = catalog.scan(os.path.dirname(pending.path)).newest()
        newest = f"iteration {whole}" if whole is not None else "none"
        return (f"the background save of {pending.path} failed ({why}); it was not marked "
                f"whole: {os.path.basename(pending.partial)} is removed by the next run on "
                f"that --save, whose newest whole checkpoint is {newest}")

    def close(self) -> Optional[str]:
        """End the worker and the results queue (not collective). A save still pending
        (the run ends on an error) is abandoned: its worker is killed and its directory
        stays unfinished; returns a line saying so, else None."""
        if self._calls is None:
            return None
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        abandoned = self.pending
        self.pending = None
        if abandoned is not None or self._failed:
            self._calls.persistent_caller.close(abort=True)
        else:
            self._calls.close()  # nothing pending: tells the worker to end, waits for it
        self._calls = None
        filesystem_async._results_queue = self._saved_queue
        self._manager.shutdown()
        if abandoned is None:
            return None
        return (f"the background save of {abandoned.path} was not finished: "
                f"{os.path.basename(abandoned.partial)} is removed by the next run on that --save")
