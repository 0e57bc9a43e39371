"""Elapsed time and ETA for the long-running commands (training steps, sampled tokens).

The ETA is the units left times the median time of the last WINDOW units: a step that compiled kernels or
warmed caches (the first), one that also validated or sampled, or one slowed while another process took the
cores, moves a median little, where it would move a mean (the first step of the default run took 20x the
others, and an ETA from it said 1h59m for a run of minutes). The first unit counts only until another is done.
"""
from __future__ import annotations

import collections
import statistics
import time

WINDOW = 25             # units whose median time gives the ETA


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
    """`total` units to do, `done` already done (a resumed run); call `tick()` after each unit (or `tick(n)`
    after n of them)."""

    def __init__(self, total: int, done: int = 0):
        self.total, self.done = total, done
        self.t0 = self.last = time.perf_counter()
        self.first: float | None = None                      # seconds per unit of the first tick
        self.recent: collections.deque = collections.deque(maxlen=WINDOW)   # seconds per unit of the later ones

    def tick(self, units: int = 1) -> None:
        now = time.perf_counter()
        per_unit = (now - self.last) / max(units, 1)
        self.last = now
        self.done += units
        if self.first is None:
            self.first = per_unit
        else:
            self.recent.extend([per_unit] * min(units, WINDOW))

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def eta(self) -> float | None:
        """Seconds left at the median time per unit of the last WINDOW units (the first unit's own time until a
        second is done); None before any unit is done."""
        if self.first is None:
            return None
        per_unit = statistics.median(self.recent) if self.recent else self.first
        return max(self.total - self.done, 0) * per_unit

    def line(self) -> str:
        eta = self.eta
        return f"{fmt_duration(self.elapsed)} elapsed" + (f", ETA {fmt_duration(eta)}" if eta is not None else "")
