"""The ``eval_downstream`` command under this module's name, for callers that run its ``main``.

The command (flags, messages, exit statuses) is :mod:`megatron_jreg.commands.eval_downstream`; the
work is :mod:`megatron_jreg.downstream.evaluate`.
"""

from megatron_jreg.commands.eval_downstream import main

__all__ = ["main"]
