"""A process lm-eval forks while eval_downstream runs takes SIGTERM's default action.

lm-eval ends its bootstrap pool with ``terminate()``. A worker that inherited the
tool's Python-level handler only dies once the handler runs, which never happens while
the worker is blocked in C (a lock another thread held at the fork): ``terminate()``
then waited for it forever."""

import os
import signal
import time

from megatron_jreg.downstream.evaluate import _signals_as_interrupt_here


def _child_disposition():
    """(SIGTERM, SIGHUP) handlers a child forked now starts with, as seen in the child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its handlers and leave at once
        os.close(read)
        dfl = [signal.getsignal(s) is signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGHUP)]
        os.write(write, bytes(dfl))
        os._exit(0)
    os.close(write)
    got = os.read(read, 2)
    os.close(read)
    os.waitpid(pid, 0)
    return list(got)


def test_forked_children_take_the_default_action_and_are_killed_at_once():
    before = signal.getsignal(signal.SIGTERM)
    with _signals_as_interrupt_here():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the tool's handler
        assert _child_disposition() == [1, 1]
        # a child blocked where no Python handler can run dies of SIGTERM all the same
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
            os.write(write, b"r")
            signal.sigwait([signal.SIGUSR1])  # blocks in C; SIGTERM is not waited for
            os._exit(3)
        assert os.read(read, 1) == b"r"  # the child runs: its handlers are set
        os.close(read)
        os.close(write)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the blocked child outlived SIGTERM (20 s)")
        status = done[1]
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
