"""The one error type every tool turns into a one-line message and exit status 2."""

from __future__ import annotations


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
        f"install it from the repository root with `pip install --no-build-isolation -e \".[{extra}]\"`"
    )
