"""Statistics over training runs: is JREG better than the baseline across seeds?

``seed_stats`` holds the one-sided paired t-test of ``tools/compare_seeds.py`` (scipy is
optional: an exact built-in t distribution stands in for it).
"""
