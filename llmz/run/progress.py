"""Elapsed time and ETA for the long-running commands (training steps, sampled tokens).

The first unit of work (step or token) includes compiling kernels and warming caches, so the rate behind
the ETA is measured from the end of the first unit on; until then the first unit's own time stands in.
"""
from __future__ import annotations

import time


def fmt_duration(seconds: float) -> str:
    """12.3s, 4m05s, 2h03m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(round(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


class Progress:
    """`total` units to do, `done` already done (a resumed run); call `tick()` after each unit."""

    def __init__(self, total: int, done: int = 0):
        self.total, self.done = total, done
        self.t0 = time.perf_counter()
        self.first: tuple[float, int] | None = None      # (time, units done) at the end of the first unit

    def tick(self, units: int = 1) -> None:
        self.done += units
        if self.first is None:
            self.first = (time.perf_counter(), self.done)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate since the first unit; None before any unit is done."""
        if self.first is None:
            return None
        now = time.perf_counter()
        t1, n1 = self.first
        rate_time, rate_units = (now - t1, self.done - n1) if self.done > n1 else (t1 - self.t0, n1)
        return max(self.total - self.done, 0) * rate_time / max(rate_units, 1)

    def line(self) -> str:
        eta = self.eta
        return f"{fmt_duration(self.elapsed)} elapsed" + (f", ETA {fmt_duration(eta)}" if eta is not None else "")
