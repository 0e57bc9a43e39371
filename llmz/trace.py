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
        title = (f"rank {self.rank}: layers (compute stream) and collectives (comm stream): F forward, "
                 "RS reduce-scatter, AG all-gather")
        if self.dev.kind != "gpu":
            title += f"\non {self.dev.kind}: no streams, every span runs after the one before"
        plot_png(events, png, title)
        return trace


def overlap_us(events: list[dict]) -> float:
    """Total time during which a comm span and a compute span run at once (µs)."""
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "compute"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "comm"]
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in comp for b0, b1 in comm)


# each stream's colour in two tones, alternating bucket by bucket so neighbouring spans stay apart
COLORS = {"compute": ("#4c8fd6", "#a9cdf2"), "comm": ("#f28e2b", "#ffd1a1")}


def long_name(name: str) -> str:
    """'reduce-scatter block6' -> 'RS block6', 'all-gather block6' -> 'AG block6', 'forward block6' -> 'F block6'."""
    return name.replace("reduce-scatter ", "RS ").replace("all-gather ", "AG ").replace("forward ", "F ")


def short_name(name: str) -> str:
    """'reduce-scatter block6' (or all-gather, forward) -> '6', 'embeddings' -> 'emb': the label of a span too
    narrow for its name (its row says which stream)."""
    name = name.split()[-1]
    return {"embeddings": "emb"}.get(name, name.replace("block", ""))


def label_span(ax, renderer, x0: float, width: float, y: float, height: float, name: str) -> None:
    """Write the span's name inside its bar: the first of (name, short name) x (across, upright) that fits
    with a margin, or nothing (a wider view in Perfetto, from the .json, shows every name)."""
    (px0, py0), (px1, py1) = ax.transData.transform([(x0, y - height / 2), (x0 + width, y + height / 2)])
    for rotation in (0, 90):
        for text in dict.fromkeys((long_name(name), short_name(name))):
            t = ax.text(x0 + width / 2, y, text, ha="center", va="center", fontsize=7, rotation=rotation)
            box = t.get_window_extent(renderer)
            if box.width <= (px1 - px0) - 3 and box.height <= (py1 - py0) - 3:
                return
            t.remove()


def micro_steps(events: list[dict]) -> list[float]:
    """Start times (µs) of the backward passes in the trace: each begins with the bucket that began the first
    (the final layernorm's), so K micro-steps give K starts."""
    comp = [e for e in events if e["tid"] == "compute"]
    return [e["ts"] for e in comp if e["name"] == comp[0]["name"]] if comp else []


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
    save_png(timeline_figure(events, title), path)


def timeline_figure(events: list[dict], title: str):
    """The spans as bars, one row per stream, each named where its bar has room; micro-steps marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 3.4))
    rows = {"compute": 1, "comm": 0}
    t0 = min((e["ts"] for e in events), default=0.0)
    end = max((e["ts"] + e["dur"] for e in events), default=1.0)
    ax.set_xlim(-0.01 * (end - t0) / 1e3, 1.01 * (end - t0) / 1e3)
    ax.set_ylim(-0.6, 1.9)
    ax.set_yticks([0, 1], ["comm stream", "compute stream"])
    ax.set_xlabel("ms since the step began\nnames where a bar has room: RS = reduce-scatter, 6 = block 6, emb = "
                  "embeddings, lnf = final layernorm;\nRS/AG/F as in the title (the .json in ui.perfetto.dev names "
                  "every span)", fontsize=9)
    ax.set_title(title, fontsize=9)
    if not events:
        ax.text(0.5, 0.5, "no spans recorded: the timeline records ZeRO stages 2 and 3",
                transform=ax.transAxes, ha="center", va="center")
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    starts = [(ts - t0) / 1e3 for ts in micro_steps(events)]
    for k, x in enumerate(starts):
        ax.axvline(x, color="gray", linestyle=":", linewidth=0.8)
        if len(starts) > 1:                      # named where there is room before the next one
            room = ax.transData.transform([(starts[k + 1] if k + 1 < len(starts) else ax.get_xlim()[1], 0),
                                           (x, 0)])
            for text in (f" micro-step {k + 1}", f" {k + 1}"):
                t = ax.text(x, 1.55, text, fontsize=8, ha="left", va="center")
                if t.get_window_extent(renderer).width <= room[0][0] - room[1][0] - 3:
                    break
                t.remove()
    bucket_index: dict[str, int] = {}
    for e in events:
        y, bucket = rows[e["tid"]], e["name"].split()[-1]
        tone = COLORS[e["tid"]][bucket_index.setdefault(bucket, len(bucket_index)) % 2]
        x0, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.broken_barh([(x0, w)], (y - 0.4, 0.8), facecolors=tone, edgecolors="black", linewidth=0.5)
        label_span(ax, renderer, x0, w, y, 0.8, e["name"])
    return fig


def save_png(fig, path: str) -> None:
    """Write a matplotlib figure as a PNG, whole or not at all (data.atomic_write), and close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, [png.getvalue()])
