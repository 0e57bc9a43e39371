"""A timeline of one training step: each layer's backward (and at ZeRO stage 3 each block's forward) on the
compute row and each collective on the comm row, written as a Chrome trace (open it in https://ui.perfetto.dev
or chrome://tracing) and as a PNG, so a learner sees block l's reduce-scatter run beside block l-1's backward,
or block l+1's all-gather beside block l's forward.

On the GPU every span is a pair of CUDA events recorded on its stream (no host synchronisation while
tracing; the times are read once, at stop()). On cpu and sim the layers run in program order on the host and
the spans are host clock readings; a collective is MPI's non-blocking call (llmz.comm), and its bar runs from
the moment it was started to the moment this rank saw it complete. MPICH moves a collective's data only inside
MPI calls, which backward makes between layers (llmz.comm's progress()), and needs two or more of them after
the start, so a bar that starts after block l ends after block l-1: the rank computed meanwhile instead of
waiting for the other rank, and the copying and adding happened in the MPI calls between the layers.

overlap(events) measures the picture: how long collectives were in flight and how much of that time a layer
was computing (hidden); the rest is exposed: the rank waited for them, or was between layers (on CPU ranks:
in the MPI calls, adding my slice into the shard, starting the next collective).
"""
from __future__ import annotations

import io
import json
import os
import time
from typing import NamedTuple

from .files import atomic_write


class Tracer:
    def __init__(self, dev, rank: int = 0):
        self.dev, self.rank = dev, rank
        self.active = False
        self.spans: list[tuple[str, str, object, object]] = []     # (name, stream, start, end)
        self.open: dict[tuple[str, str], object] = {}
        self.measured: Overlap | None = None     # what the last stop() measured (overlap())

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

    def end(self, name: str, stream: str, at: float | None = None) -> None:
        """at (cpu, sim): the host clock reading where the span ended, if not now."""
        if self.active and (name, stream) in self.open:
            self.spans.append((name, stream, self.open.pop((name, stream)), self._mark(stream) if at is None else at))

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
        self.measured = overlap(events)         # this rank's, for the run's line (llmz.trainer)
        if self.rank != 0:                      # every rank traces; rank 0's timeline is written
            return trace
        atomic_write(path, [json.dumps(trace, indent=1).encode()])
        png = os.path.splitext(path)[0] + ".png"
        where = ("the compute and the comm stream" if self.dev.kind == "gpu" else f"{self.dev.kind}: a collective's "
                 "bar runs from its start until this rank saw it complete, between two layers")
        plot_png(events, png, f"rank {self.rank}: layers and collectives of one step ({where})\n"
                 f"{legend(events)} | {self.measured}", streams=self.dev.kind == "gpu")
        return trace


class Overlap(NamedTuple):
    """What a timeline says about communication: comm_ms, the time at least one collective was in flight;
    hidden_ms, the part of it during which a layer was computing. The rest, comm_ms - hidden_ms, is exposed
    (the rank waited, or did other work between layers)."""
    comm_ms: float
    hidden_ms: float

    @property
    def share(self) -> float:
        """The share of the collectives' time hidden behind compute (0 when nothing was in flight)."""
        return self.hidden_ms / self.comm_ms if self.comm_ms > 0 else 0.0

    def __str__(self) -> str:
        return (f"collectives in flight {self.comm_ms:.2f} ms, {self.hidden_ms:.2f} ms of it behind compute "
                f"({self.share:.0%} hidden), {self.comm_ms - self.hidden_ms:.2f} ms exposed")


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals (start, end) merged where they overlap: the time covered, each instant once."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(events: list[dict]) -> Overlap:
    """The overlap of a trace (one rank's events, as Tracer.stop returns them): the time covered by comm spans,
    and the part of it also covered by compute spans."""
    comp = union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "compute"])
    comm = union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == "comm"])
    hidden = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in comp for b0, b1 in comm)
    return Overlap(sum(b - a for a, b in comm) / 1e3, hidden / 1e3)


# what each kind of span is called in the legend, by the prefix of its name (a compute span without one is a
# layer's backward)
KINDS = {"forward ": "F forward", "reduce-scatter ": "RS reduce-scatter", "all-gather ": "AG all-gather"}


def legend(events: list[dict]) -> str:
    """The abbreviations used in the bars' labels, for the kinds of span present only."""
    present = [text for prefix, text in KINDS.items() if any(e["name"].startswith(prefix) for e in events)]
    return ", ".join(present) if present else "no spans"


# a colour per kind of span (compute; reduce-scatter; all-gather) in two tones, alternating bucket by bucket so
# neighbouring spans stay apart
COLORS = {"compute": ("#4c8fd6", "#a9cdf2"), "reduce-scatter": ("#f28e2b", "#ffd1a1"),
          "all-gather": ("#59a14f", "#b5dcae")}


def colors(e: dict) -> tuple[str, str]:
    return COLORS["compute"] if e["tid"] == "compute" else COLORS.get(e["name"].split()[0], COLORS["reduce-scatter"])


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
    """Start times (µs) of the micro-steps in the trace: each begins with the compute span that began the first
    (stage 2: the final layernorm's backward; stage 3: block 0's forward), so K micro-steps give K starts."""
    comp = sorted((e for e in events if e["tid"] == "compute"), key=lambda e: e["ts"])
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


def plot_png(events: list[dict], path: str, title: str, streams: bool = True) -> None:
    save_png(timeline_figure(events, title, streams), path)


def lanes(spans: list[dict]) -> dict[int, tuple[int, int]]:
    """Spans of one row that overlap in time (collectives in flight together) go into lanes, stacked: id(span) ->
    (its lane, the row's number of lanes). Each span takes the first lane free at its start."""
    ends: list[float] = []
    lane = {}
    for e in sorted(spans, key=lambda e: e["ts"]):
        i = next((i for i, t in enumerate(ends) if t <= e["ts"]), len(ends))
        ends[i:i + 1] = [e["ts"] + e["dur"]]
        lane[id(e)] = i
    return {k: (i, len(ends)) for k, i in lane.items()}


def timeline_figure(events: list[dict], title: str, streams: bool = True):
    """The spans as bars, one row per stream (streams=False: the host's layers and MPI's collectives in flight),
    spans in flight together stacked in lanes; each named where its bar has room; micro-steps marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 3.4))
    rows = {"compute": 1, "comm": 0}
    t0 = min((e["ts"] for e in events), default=0.0)
    end = max((e["ts"] + e["dur"] for e in events), default=1.0)
    ax.set_xlim(-0.01 * (end - t0) / 1e3, 1.01 * (end - t0) / 1e3)
    ax.set_ylim(-0.6, 1.9)
    ax.set_yticks([0, 1], ["comm stream", "compute stream"] if streams else ["collectives\nin flight",
                                                                             "layers\ncomputing"])
    ax.set_xlabel("ms since the step began\nnames where a bar has room: 6 = block 6, emb = embeddings, lnf = "
                  "final layernorm;\nRS/AG/F as in the title (the .json in ui.perfetto.dev names "
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
    lane = {**lanes([e for e in events if e["tid"] == "compute"]), **lanes([e for e in events if e["tid"] == "comm"])}
    for e in events:
        bucket = e["name"].split()[-1]
        tone = colors(e)[bucket_index.setdefault(bucket, len(bucket_index)) % 2]
        i, n = lane[id(e)]
        h = 0.8 / n
        y = rows[e["tid"]] + 0.4 - (i + 0.5) * h             # lane 0 on top
        x0, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.broken_barh([(x0, w)], (y - h / 2, h), facecolors=tone, edgecolors="black", linewidth=0.5)
        label_span(ax, renderer, x0, w, y, h, e["name"])
    return fig


def save_png(fig, path: str) -> None:
    """Write a matplotlib figure as a PNG, whole or not at all (data.atomic_write), and close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, [png.getvalue()])
