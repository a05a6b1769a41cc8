"""Measuring the final-layer jump of trained models: displacement, jump rates, reports.

Light at import time: transformers, matplotlib, scipy and megatron's dataset code are
imported only by the functions that need them.
"""

from megatron_jreg.analysis.compare import ReportComparison, compare_reports, load_report
from megatron_jreg.analysis.errors import InputError
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator, JumpReport, reports_to_csv
from megatron_jreg.analysis.measure import measure_jump, pad_batch
from megatron_jreg.analysis.seed_stats import OneSidedTTest, one_sided_t_test, paired_one_sided_t_test
from megatron_jreg.analysis.sources import HiddenStateSource, SourceEntry, SourceKind, builtin_source_kinds

__all__ = [
    "HiddenStateSource",
    "InputError",
    "JumpAccumulator",
    "JumpReport",
    "OneSidedTTest",
    "ReportComparison",
    "SourceEntry",
    "SourceKind",
    "builtin_source_kinds",
    "compare_reports",
    "load_report",
    "measure_jump",
    "one_sided_t_test",
    "pad_batch",
    "paired_one_sided_t_test",
    "reports_to_csv",
]
