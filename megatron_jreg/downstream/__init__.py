"""Downstream tasks (the paper's Table 3) through lm-evaluation-harness: task names and
metrics, the harness call, the per-(model, task, limit) result cache, the report."""
