"""megatron-jreg: Llama pretraining on megatron-core with the JREG jump regularizer."""

import os as _os
import warnings as _warnings

__version__ = "0.1.0"

# Warnings megatron-core 0.16.1 and torch's checkpoint code raise about their own internals
# on every run: nothing a user of this project can act on, and they bury the log line.
# MEGATRON_JREG_LIBRARY_WARNINGS=1 shows them.
if _os.environ.get("MEGATRON_JREG_LIBRARY_WARNINGS") != "1":
    for _message in (
        r"Transformer Engine and Apex are not installed",  # the documented CPU/torch path
        r"Apex is not installed",
        r"full scope is deprecated",
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"`load_state_dict` is deprecated and will be removed",
    ):
        _warnings.filterwarnings("ignore", message=_message)

# megatron-core's ~40 torch.compile decorations run on first call, not at import (1.7 s of
# every process that imports megatron-core; docs/design.md, "Start-up time").
from megatron_jreg.platform import lazy_compile as _lazy_compile  # noqa: E402

_lazy_compile.install()
