"""Measuring the final-layer jump of trained models: displacement, jump rates, reports.

Names are imported on first use, so a tool that needs one module does not pay for torch,
and transformers, matplotlib and megatron's dataset code load only in the functions that
need them. Checkpoint loading and the Hugging Face export live in
:mod:`megatron_jreg.checkpoint`, seed statistics in :mod:`megatron_jreg.stats`.
"""

from importlib import import_module

_EXPORTS = {
    "InputError": "megatron_jreg.errors",
    "JumpAccumulator": f"{__name__}.jump_accumulator",
    "JumpReport": f"{__name__}.jump_accumulator",
    "reports_to_csv": f"{__name__}.jump_accumulator",
    "ReportComparison": f"{__name__}.compare",
    "compare_reports": f"{__name__}.compare",
    "load_report": f"{__name__}.compare",
    "measure_jump": f"{__name__}.measure",
    "pad_batch": f"{__name__}.batching",
    "MeasureWorld": f"{__name__}.batching",
    "HiddenStateSource": f"{__name__}.sources",
    "SourceEntry": f"{__name__}.sources",
    "SourceKind": f"{__name__}.sources",
    "builtin_source_kinds": f"{__name__}.source_kinds",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
