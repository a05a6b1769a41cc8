"""The exit statuses of the commands, and :func:`run_command`, which turns a user error into one.

A :class:`~megatron_jreg.errors.UserError`, or an OS error of writing (``errors.WRITE_ERRNOS``:
a full disk, a denied permission, ...) however a library wrapped it, is printed on one line of
stderr (naming the file, the cause and the fix: ``errors.write_error_line``) and returns
``USAGE``; any other exception keeps its traceback: it is a bug or a system fault.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Tuple, Type

from megatron_jreg.checkpoint.faults import TRAINER, Wording, phrase
from megatron_jreg.errors import UserError, write_error_line

OK = 0
FAILED = 1  # an unexpected exception: Python's own status for a traceback
USAGE = 2  # bad flags, inputs or data, or no room to write: the user must fix something
# (argparse uses 2 too)
NONFINITE = 3  # eval_jump: a measured model's hidden states are not finite (the trainer's NaN loss)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
TERMINATED = 143  # SIGTERM (128 + SIGTERM)


def run_command(body: Callable[[], int], prefix: str = "error",
                also: Tuple[Type[BaseException], ...] = (), say: bool = True,
                output: Optional[str] = None, wording: Wording = TRAINER) -> int:
    """``body()``'s exit status; a ``UserError`` (or one of ``also``) becomes the line
    ``<prefix>: <message>`` on stderr (when ``say``) and ``USAGE``, and so does an OS error
    of writing (``output``, the command's output, is named when the error names no file).
    A checkpoint's fault is phrased with the command's flags (``wording``)."""
    try:
        return body()
    except (UserError, *also) as err:
        if say:
            print(f"{prefix}: {phrase(err, wording)}", file=sys.stderr)
        return USAGE
    except BaseException as err:  # torch's CheckpointException is a BaseException
        line = write_error_line(err, output)
        if line is None:
            raise
        if say:
            print(f"{prefix}: {line}", file=sys.stderr)
        return USAGE
