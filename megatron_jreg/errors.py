"""The one error type every tool turns into a one-line message and exit status 2, and the
OS errors of writing that every tool reports the same way (:func:`write_error_line`)."""

from __future__ import annotations

import errno
import os
import re
from typing import Optional, Tuple


class UserError(ValueError):
    """A problem with what the user gave us; a command prints it on one line and exits 2."""


class ConfigError(UserError):
    """A setting, or a combination of settings, that cannot make a run."""


class InputError(UserError):
    """A problem with what the user gave us (a path, a flag, a file's contents).

    The message names the bad value and the fix; ``tools/*.py`` print it on one line and
    exit with status 2, without a traceback.
    """


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def missing_extra(package: str, extra: str, purpose: str) -> InputError:
    """The error for an optional dependency that is not installed."""
    return InputError(
        f"{package} is not installed but is needed for {purpose}; "
        "install it from the repository root with "
        f"`pip install --no-build-isolation -e \".[{extra}]\"`"
    )


# OS errors of writing that the user fixes where the files go, not in the code: (cause, fix).
# EACCES and EPERM also come from reading: their line does not say "write".
WRITE_ERRNOS = {
    errno.ENOSPC: ("the disk is full", "free space or write elsewhere"),
    errno.EDQUOT: ("the disk quota is used up", "free space or write elsewhere"),
    errno.EFBIG: ("the file size limit (ulimit -f{limit}) was reached",
                  "raise it (`ulimit -f unlimited`) or write smaller files"),
    errno.EROFS: ("the file system is read-only", "write elsewhere, or remount it read-write"),
    errno.EACCES: ("permission denied", "give this user access to it or use another path"),
    errno.EPERM: ("operation not permitted", "give this user access to it or use another path"),
}
# Libraries that wrap the OS error in their own keep its number in the text: Python's
# OSError ("[Errno 28] No space left on device: 'PATH'", as megatron-core's writer passes it
# on), Rust's std::io::Error (tokenizers, safetensors: "(os error 27)").
_PYTHON_TEXT = re.compile(r"\[Errno (\d+)\] [^:'\n]*(?:: '((?:[^'\\\n]|\\.)*)')?")
_RUST_TEXT = re.compile(r"\(os error (\d+)\)")


def _causes(err: BaseException):
    """``err`` and every exception behind it: ``__cause__``, ``__context__`` and the ranks'
    errors of torch's CheckpointException (``failures``: rank -> (error, traceback))."""
    seen, stack = set(), [err]
    while stack:
        e = stack.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [e.__cause__, e.__context__]


def os_write_error(err: BaseException) -> Optional[Tuple[int, Optional[str]]]:
    """(errno, file name or None) of the OS error of :data:`WRITE_ERRNOS` that ``err`` is
    or holds, found through the exception chain and the text of wrapping libraries; None
    when it holds none. Of several, the first that names its file."""
    found = None
    for e in _causes(err):
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            code, name = e.errno, e.filename
        else:
            text = str(e)
            match = _PYTHON_TEXT.search(text) or _RUST_TEXT.search(text)
            if not match or int(match.group(1)) not in WRITE_ERRNOS:
                continue
            code = int(match.group(1))
            name = match.group(2) if match.re is _PYTHON_TEXT else None
        if name is not None:
            return code, os.fsdecode(name)
        found = found or (code, None)
    return found


def write_error_at(path: str) -> Optional[OSError]:
    """The OS error a failed write of file ``path`` (or of files under directory ``path``)
    met, told by what it left, for a library whose error lost the number (torch's zip
    writer: "unexpected pos"): a file at the file size limit, a read-only or full file
    system. None when nothing shows."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        limit = -1
    files = [path] if not os.path.isdir(path) else [
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    if limit >= 0:
        for name in files:
            try:
                if os.path.getsize(name) >= limit:
                    return OSError(errno.EFBIG, os.strerror(errno.EFBIG), name)
            except OSError:
                continue
    place = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        fs = os.statvfs(place)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    if fs.f_bavail == 0:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return None


def write_error_line(err: BaseException, output: Optional[str] = None) -> Optional[str]:
    """The one line (without ``error:``) for an OS error of :data:`WRITE_ERRNOS` behind
    ``err``: the file, the cause and the fix; ``output`` is named when the error does not
    name its file. None for any other error."""
    found = os_write_error(err)
    if found is None:
        return None
    code, path = found
    if code in (errno.EACCES, errno.EPERM) and path is None:
        return None  # not known to be about a file: os.kill, prctl, ... keep their traceback
    path = path or output
    cause, fix = WRITE_ERRNOS[code]
    if code == errno.EFBIG:
        cause = cause.format(limit=_size_limit())
    if code in (errno.EACCES, errno.EPERM):
        return f"{path}: {cause}; {fix}"
    return f"cannot write {path}: {cause}; {fix}" if path else f"a write failed: {cause}; {fix}"


def _size_limit() -> str:
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return ""
    return "" if limit == resource.RLIM_INFINITY else f": {limit} bytes"
