"""Measuring the final-layer jump of trained models: displacement, jump rates, reports.

Names are imported on first use, so ``tools/compare_seeds.py`` does not pay for torch,
and transformers, matplotlib, scipy and megatron's dataset code load only in the
functions that need them.
"""

from importlib import import_module

_EXPORTS = {
    "InputError": "errors",
    "JumpAccumulator": "jump_accumulator",
    "JumpReport": "jump_accumulator",
    "reports_to_csv": "jump_accumulator",
    "ReportComparison": "compare",
    "compare_reports": "compare",
    "load_report": "compare",
    "measure_jump": "measure",
    "pad_batch": "measure",
    "OneSidedTTest": "seed_stats",
    "one_sided_t_test": "seed_stats",
    "paired_one_sided_t_test": "seed_stats",
    "HiddenStateSource": "sources",
    "SourceEntry": "sources",
    "SourceKind": "sources",
    "builtin_source_kinds": "sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
