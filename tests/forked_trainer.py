"""Single-rank trainer runs forked from a process that has already imported the trainer.

A tiny ``python -m megatron_jreg.train`` run spends about 2.5 of its 4 s importing torch,
megatron-core and torch._dynamo (the optimizer imports it), and the suite starts about a
hundred such runs. :func:`run` forks each one from a server process (this file run as a
script) that has done those imports once. The child is still a process of its own: its
own pid, working directory, environment, stdout and stderr (captured to files) and exit
code; it runs ``megatron_jreg.train`` as ``__main__`` through runpy, as ``python -m`` does,
and exits through the interpreter's exit steps (threads joined, atexit handlers).

A server is only used for a run whose import-time environment (the variables in
``IMPORT_ENV``) is the one it was started with; a run that differs starts its own server.
:func:`run_tool` runs a script (one of tools/) the same way. Tests that launch the trainer
or a tool under torchrun, or that need its pid before it finishes (signals, kills), start
real processes. ``MEGATRON_JREG_TEST_FORK=0`` runs every run in a fresh interpreter
instead; ``tests/training/test_forked_trainer.py`` checks that both ways give the same run.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# read when torch and the package are imported, so fixed for a server's lifetime
IMPORT_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONWARNINGS", "PYTHONPATH",
              "PYTHONHASHSEED", "MEGATRON_JREG_LIBRARY_WARNINGS", "MEGATRON_JREG_DEVICE")

_lock = threading.Lock()
_idle = {}  # import-time environment -> servers waiting for a run


def enabled():
    return os.environ.get("MEGATRON_JREG_TEST_FORK", "1") != "0"


class _Server:
    def __init__(self, env):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=REPO,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0)
        self.pending = b""
        ready = self._reply(timeout=300)
        if ready != "ready":
            self.proc.kill()
            raise RuntimeError(f"the trainer server did not start: {ready!r}")

    def _reply(self, timeout=None):
        """The server's next line, or None when ``timeout`` seconds pass first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the trainer server ended ({self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def run(self, argv, cwd, env, timeout, script=None):
        with tempfile.TemporaryDirectory(prefix="forked-trainer-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": out, "stderr": err,
                       "script": script}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = json.loads(self._reply())["pid"]
            reply = self._reply(timeout)
            timed_out = reply is None
            if timed_out:  # the child is still running: as subprocess.run's timeout
                os.kill(pid, signal.SIGKILL)
                reply = self._reply()
            code = json.loads(reply)["returncode"]
            with open(out, encoding="utf-8", errors="replace") as f_out, \
                    open(err, encoding="utf-8", errors="replace") as f_err:
                stdout, stderr = f_out.read(), f_err.read()
        args = [sys.executable, *([script] if script else ["-m", "megatron_jreg.train"]), *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(args, code, stdout, stderr)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _close_all():
    for servers in _idle.values():
        for server in servers:
            server.close()


atexit.register(_close_all)


def run(argv, cwd, env, timeout, script=None):
    """``python -m megatron_jreg.train *argv`` (``python SCRIPT *argv`` for a ``script``, a
    path relative to ``cwd``: one of tools/) in ``cwd`` with ``env``, stdout and stderr
    captured as text: a ``subprocess.CompletedProcess``."""
    argv = [str(a) for a in argv]
    if not enabled():
        head = [script] if script else ["-m", "megatron_jreg.train"]
        return subprocess.run([sys.executable, *head, *argv], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=timeout)
    key = tuple(env.get(name) for name in IMPORT_ENV)
    with _lock:
        pool = _idle.setdefault(key, [])
        server = pool.pop() if pool else None
    if server is None or server.proc.poll() is not None:
        server = _Server(env)
    try:
        result = server.run(argv, cwd, env, timeout, script)
    except BaseException:
        server.proc.kill()
        raise
    with _lock:
        _idle[key].append(server)
    return result


def run_tool(script, argv, env, cwd=REPO, timeout=600):
    """``python SCRIPT *argv`` (``script``: a path such as ``tools/eval_jump.py``, relative
    to ``cwd``, or absolute), forked as :func:`run` forks the trainer.

    The child is not a new interpreter in what the server set up before the fork: its umask,
    the modules the server imported (a test that checks what a tool imports, or the warnings
    importing torch and megatron-core raises, needs a new interpreter), and what those
    modules read from the environment as they were imported (tqdm's ``TQDM_*`` defaults)."""
    return run(argv, cwd, env, timeout, script=str(script))


# ---------------------------------------------------------------------------- the server


def _exit_code(code):
    """The exit status ``sys.exit(code)`` gives a Python process."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request):
    """In the forked process: become ``python -m megatron_jreg.train`` (or ``python
    SCRIPT``), run, exit."""
    import runpy
    import traceback

    code = 1
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request.get("script")
        if script:  # what a new interpreter takes from its start: the temporary directory
            # (tempfile caches TMPDIR's) and the directory spawn resolves a relative script in
            import multiprocessing.process

            tempfile.tempdir = None
            multiprocessing.process.ORIGINAL_DIR = os.path.abspath(os.getcwd())
        sys.argv = [script or "-m", *request["argv"]]
        # as python -m (the working directory) and python SCRIPT (its directory) set it
        sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
        try:
            if script:
                runpy.run_path(script, run_name="__main__")
            else:
                runpy.run_module("megatron_jreg.train", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = _exit_code(exit_.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the interpreter ends: by SIGINT
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter's exit: join non-daemon threads, atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve():
    # what a tiny run imports, done once; nothing runs a tensor op here, so the children
    # fork from a process with one thread
    import torch._dynamo  # noqa: F401  (torch.optim imports it as the optimizer is built)

    import megatron_jreg.training.experiment  # noqa: F401
    import megatron_jreg.training.trainer  # noqa: F401

    assert threading.active_count() == 1, threading.enumerate()
    requests, replies = sys.stdin, sys.stdout
    print("ready", file=replies, flush=True)
    for line in requests:
        request = json.loads(line)
        replies.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies,
              flush=True)


if __name__ == "__main__":
    serve()
