"""Progress for long preprocessing runs: a bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class RunStats:
    """Running totals of a preprocessing run (also its final summary)."""

    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict[str, str] = field(default_factory=dict)
    """Reason -> ``file:line`` of its first skipped line."""
    counts: Counter = field(default_factory=Counter)
    """Totals of one kind of data (SFT: ``truncated``, ``loss_tokens``)."""
    seconds: float = 0.0

    def merge(self, other: "RunStats") -> None:
        self.documents += other.documents
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.skipped.update(other.skipped)
        self.counts.update(other.counts)
        for reason, where in other.first_skipped.items():
            self.first_skipped.setdefault(reason, where)

    def summary(self) -> str:
        lines = [
            f"done: {self.documents} documents, {self.tokens} tokens, "
            f"{self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s "
            f"({self.documents / max(self.seconds, 1e-9):.0f} docs/s, "
            f"{self.bytes / 1e6 / max(self.seconds, 1e-9):.1f} MB/s), "
            f"skipped {sum(self.skipped.values())}"
        ]
        if self.counts:
            lines.append("  " + ", ".join(f"{key.replace('_', ' ')} {value}"
                                          for key, value in sorted(self.counts.items())))
        for reason, count in sorted(self.skipped.items()):
            lines.append(f"  skipped {count} x {reason} (first at {self.first_skipped[reason]})")
        return "\n".join(lines)


class Progress:
    """Documents, tokens and MB/s: a tqdm bar when ``stream`` is a terminal, else a log line
    every ``log_interval`` documents (Megatron-LM's ``--log-interval``)."""

    def __init__(self, log_interval: int, stream: TextIO | None = None, label: str = "") -> None:
        self.stream = stream or sys.stderr
        self.log_interval = log_interval
        self.label = label
        self.start = time.perf_counter()
        self._next_log = log_interval
        self._bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(unit=" docs", file=self.stream, desc=label or "preprocess",
                             dynamic_ncols=True, smoothing=0.1)

    def update(self, stats: RunStats, new_documents: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        if self._bar is not None:
            self._bar.update(new_documents)
            self._bar.set_postfix_str(
                f"{stats.tokens / 1e6:.1f}M tok, {stats.bytes / 1e6 / elapsed:.1f} MB/s",
                refresh=False,
            )
        elif stats.documents >= self._next_log:
            self._next_log = (stats.documents // self.log_interval + 1) * self.log_interval
            print(
                f"{self.label}processed {stats.documents} documents, {stats.tokens} tokens, "
                f"{stats.bytes / 1e6:.1f} MB ({stats.documents / elapsed:.0f} docs/s, "
                f"{stats.bytes / 1e6 / elapsed:.2f} MB/s)",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
