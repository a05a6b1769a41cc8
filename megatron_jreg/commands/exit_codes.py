"""The exit statuses of the commands, and the wrapper that turns a user error into one.

A command's body raises :class:`~megatron_jreg.errors.UserError` (or a subclass) for a
problem with what the user gave; :func:`run_command` prints it on one line of stderr and
returns ``USAGE``. Any other exception keeps its traceback: it is a bug or a system fault.
"""

from __future__ import annotations

import sys
from typing import Callable, Tuple, Type

from megatron_jreg.errors import UserError

OK = 0
FAILED = 1  # an unexpected exception: Python's own status for a traceback
USAGE = 2  # bad flags, inputs or data: the user must fix something (argparse uses 2 too)
NONFINITE = 3  # eval_jump: a measured model's hidden states are not finite (the trainer's NaN loss)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
TERMINATED = 143  # SIGTERM (128 + SIGTERM)


def run_command(body: Callable[[], int], prefix: str = "error",
                also: Tuple[Type[BaseException], ...] = (), say: bool = True) -> int:
    """``body()``'s exit status; a ``UserError`` (or one of ``also``) becomes the line
    ``<prefix>: <message>`` on stderr (when ``say``) and ``USAGE``."""
    try:
        return body()
    except (UserError, *also) as err:
        if say:
            print(f"{prefix}: {err}", file=sys.stderr)
        return USAGE
