"""The ``convert_from_hf`` command under this module's name, for callers that run its ``main``.

The command (flags, messages, exit statuses) is :mod:`megatron_jreg.commands.convert_from_hf`; the
work is :mod:`megatron_jreg.checkpoint.from_hf`.
"""

from megatron_jreg.commands.convert_from_hf import main

__all__ = ["main"]
