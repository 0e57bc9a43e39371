"""A timeline of one training step: each layer's backward (and at ZeRO stage 3 each block's forward) on the
compute stream and each collective on the comm stream, written as a Chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing) and as a PNG, so a learner sees block l's reduce-scatter run
beside block l-1's backward, or block l+1's all-gather beside block l's forward.

On the GPU every span is a pair of CUDA events recorded on its stream (no host synchronisation while
tracing; the times are read once, at stop()). On cpu and sim everything runs in program order, so the
spans are host clock readings and the picture shows the collectives serialised with backward.
"""
from __future__ import annotations

import io
import json
import os
import time

from .data import atomic_write


class Tracer:
    def __init__(self, dev, rank: int = 0):
        self.dev, self.rank = dev, rank
        self.active = False
        self.spans: list[tuple[str, str, object, object]] = []     # (name, stream, start, end)
        self.open: dict[tuple[str, str], object] = {}

    def _mark(self, stream_name: str):
        if self.dev.kind == "gpu":
            e = self.dev.event(timing=True)
            e.record(self.dev.compute_stream if stream_name == "compute" else self.dev.comm_stream)
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.active, self.spans, self.open = True, [], {}
        self.t0 = self._mark("compute")

    def begin(self, name: str, stream: str) -> None:
        if self.active:
            self.open[(name, stream)] = self._mark(stream)

    def end(self, name: str, stream: str) -> None:
        if self.active and (name, stream) in self.open:
            self.spans.append((name, stream, self.open.pop((name, stream)), self._mark(stream)))

    def _us(self, mark) -> float:
        if self.dev.kind == "gpu":
            import cupy
            return cupy.cuda.get_elapsed_time(self.t0.cupy, mark.cupy) * 1e3
        return (mark - self.t0) * 1e6

    def stop(self, path: str) -> dict:
        """Rank 0 writes the Chrome trace to `path` and a PNG beside it; every rank returns its trace dict."""
        self.active = False
        self.dev.synchronize()
        events = []
        for name, stream, s, e in self.spans:
            ts, te = self._us(s), self._us(e)
            events.append({"name": name, "ph": "X", "ts": ts, "dur": max(te - ts, 0.0), "pid": self.rank,
                           "tid": stream, "cat": "comm" if stream == "comm" else
                           "forward" if name.startswith("forward") else "backward"})
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if self.rank != 0:                      # every rank traces; rank 0's timeline is written
            return trace
        atomic_write(path, [json.dumps(trace, indent=1).encode()])
        png = os.path.splitext(path)[0] + ".png"
        plot_png(events, png, f"rank {self.rank}: layers (compute stream) and collectives (comm stream): "
                              "F forward, RS reduce-scatter, AG all-gather")
        return trace


def overlap_us(events: list[dict]) -> float:
    """Total time during which a comm span and a compute span run at once (µs)."""
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "compute"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "comm"]
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in comp for b0, b1 in comm)


def gathers_ahead(events: list[dict]) -> tuple[int, int]:
    """ZeRO stage 3: for every compute span of a block, the all-gather of that block it used (the latest one
    begun before it); counts those that began before the compute span in front of it ended, that is, were
    issued while the previous block computed (prefetched). Returns (prefetched, block compute spans)."""
    comp = sorted((e for e in events if e["tid"] == "compute"), key=lambda e: e["ts"])
    gathers = [e for e in events if e["tid"] == "comm" and e["name"].startswith("all-gather block")]
    ahead = total = 0
    for i, c in enumerate(comp):
        block = c["name"].split()[-1]
        used = [g["ts"] for g in gathers if g["name"] == f"all-gather {block}" and g["ts"] <= c["ts"]]
        if not block.startswith("block") or not used:
            continue
        total += 1
        ahead += i > 0 and max(used) < comp[i - 1]["ts"] + comp[i - 1]["dur"]
    return ahead, total


def plot_png(events: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 2.8))
    rows = {"compute": 1, "comm": 0}
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    t0 = min((e["ts"] for e in events), default=0.0)
    for e in events:
        y = rows[e["tid"]]
        ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.4, 0.8), facecolors=colors[e["tid"]],
                       edgecolors="black", linewidth=0.5)
        if e["dur"] > 0:
            label = e["name"].replace("reduce-scatter ", "RS ").replace("all-gather ", "AG ")
            ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, y, label.replace("forward ", "F "),
                    ha="center", va="center", fontsize=6, rotation=90 if e["tid"] == "comm" else 0)
    ax.set_yticks([0, 1], ["comm stream", "compute stream"])
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=9)
    save_png(fig, path)


def save_png(fig, path: str) -> None:
    """Write a matplotlib figure as a PNG, whole or not at all (data.atomic_write), and close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, [png.getvalue()])
