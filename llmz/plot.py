"""Training curves from `python -m llmz.train --log` files: one PNG, several runs overlaid.

    python -m llmz.plot run.jsonl [more.jsonl ...] -o curves.png

Four panels share the x axis (the step, or with `--x tokens` the tokens seen): the loss (each step's training
loss, faint, a centred moving average of it on top, and the validation loss as dots), the gradient norm
before clipping, the learning rate, and tokens/s. Each run has one colour, named in the legend by its file
and, from its start record, its ZeRO stage and number of ranks: lay stage 0's curve over stage 2's.

The log format (llmz/run/log.py): a `{"event": "start", ...}` record, one `{"step", "loss", "lr",
"grad_norm", "ms", "tokens_per_s", ...}` record per step, `{"step", "val_loss"}` records, and
`{"event": ...}` records (checkpoint, end). Records and fields it does not know are skipped; a step logged
twice (a log that continues a resumed run) keeps its last record.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field

from .errors import LlmzError
from .files import loads_json

FORMATS = ("png", "svg", "pdf")
# one line style per run besides its colour, so a run that repeats another's numbers (stage 2 over stage 0)
# shows as a dashed line on a solid one instead of hiding it
STYLES = ("-", "--", ":", "-.")


@dataclass
class LogFile:
    """What one --log file holds (llmz.run.log writes it), sorted by step."""
    path: str
    label: str
    start: dict = field(default_factory=dict)       # the start record ({} if the log has none)
    end: dict = field(default_factory=dict)         # the end record ({} if the run did not finish)
    train: dict[int, dict] = field(default_factory=dict)    # step -> its record (loss, lr, grad_norm, ...)
    val: dict[int, float] = field(default_factory=dict)     # step -> val_loss

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one per-step field, over the steps that have it as a number."""
        pts = [(s, r[key]) for s, r in sorted(self.train.items()) if _number(r.get(key))]
        return [s for s, _ in pts], [float(v) for _, v in pts]

    @property
    def tokens_per_step(self) -> int | None:
        """B * T * K * ranks, from the start record's flags (None if it is missing)."""
        a = self.start.get("args") or {}
        parts = (a.get("batch_size"), a.get("seq_len"), a.get("grad_accum", 1), self.start.get("world_size", 1))
        return math.prod(parts) if all(isinstance(p, int) and p > 0 for p in parts) else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def describe(start: dict) -> str:
    """'ZeRO 2, 2 ranks, fp32' from a start record ('' if it has none of these)."""
    a = start.get("args") or {}
    bits = []
    if _number(a.get("zero_stage")):
        bits.append(f"ZeRO {a['zero_stage']}")
    if _number(start.get("world_size")):
        n = start["world_size"]
        bits.append(f"{n} rank" + ("s" if n != 1 else ""))
    if isinstance(a.get("precision"), str):
        bits.append(a["precision"])
    return ", ".join(bits)


def read_log(path: str) -> LogFile:
    """Parse one --log file; an unreadable or malformed one raises LlmzError naming the file and line."""
    if not os.path.exists(path):
        raise LlmzError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise LlmzError(f"{path}: not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise LlmzError(f"{path}: cannot read as a text log ({getattr(e, 'strerror', None) or e})") from None
    log = LogFile(path, "")
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = loads_json(line)
        except json.JSONDecodeError as e:
            if i == len(lines):         # the last line, cut short (the run was killed mid-write): skip it
                print(f"{path}: line {i} is incomplete, skipped", file=sys.stderr)
                continue
            raise LlmzError(f"{path}: line {i} is not JSON ({e.msg}); is it a --log file of llmz.train?") from None
        if not isinstance(rec, dict):
            raise LlmzError(f"{path}: line {i} is not a JSON object; is it a --log file of llmz.train?")
        step = rec.get("step")
        if rec.get("event") == "start":
            log.start = rec
        elif rec.get("event") == "end":
            log.end = rec
        elif "event" in rec or not _number(step):
            continue                    # checkpoints, and records this reader does not know
        elif _number(rec.get("val_loss")):
            log.val[int(step)] = float(rec["val_loss"])
        elif _number(rec.get("loss")):
            log.train[int(step)] = rec
    if not log.train and not log.val:
        raise LlmzError(f"{path}: no step records with a loss; is it a --log file of llmz.train?")
    return log


def label_runs(runs: list[LogFile], labels: list[str] | None = None) -> None:
    """Name each run for the legend: the given labels, else the file's name (a run folder's log.jsonl: the
    folder's; their paths where two names are the same) and what its start record says (ZeRO stage, ranks,
    precision)."""
    if labels:
        for run, label in zip(runs, labels):
            run.label = label
        return

    def name(path: str, whole: bool) -> str:
        if os.path.basename(path) == "log.jsonl":               # llmz.run.folder's runs/001/log.jsonl: "001"
            folder = os.path.dirname(path) or "."
            return folder if whole else os.path.basename(os.path.abspath(folder))
        return os.path.splitext(path if whole else os.path.basename(path))[0]
    names = [name(r.path, False) for r in runs]
    if len(set(names)) < len(names):
        names = [name(r.path, True) for r in runs]
    for run, name in zip(runs, names):
        what = describe(run.start)
        run.label = f"{name} ({what})" if what else name


def moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points (odd), the window shrinking symmetrically at the ends (the
    first and last points are their own): no lag, so a smoothed curve drops where the raw one drops."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    n, out = len(values), []
    for i in range(n):
        h = min(window // 2, i, n - 1 - i)
        out.append((sums[i + h + 1] - sums[i - h]) / (2 * h + 1))
    return out


def auto_window(runs: list[LogFile]) -> int:
    """The default smoothing: an odd window of about 1/50 of the longest run's steps (1: none)."""
    n = max(len(r.train) for r in runs)
    return (n // 50) | 1


def figure(runs: list[LogFile], x: str = "step", smooth: int = 1, title: str | None = None):
    """A matplotlib figure of the runs' curves (four panels; per-step values averaged over `smooth` steps,
    the raw ones faint behind). Every line of a run carries its label; val-loss lines' labels end in (val)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True, layout="constrained")
    ax_loss, ax_norm, ax_lr, ax_tps = axes.flat
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c, ls = colors[i % len(colors)], STYLES[i % len(STYLES)]
        scale = run.tokens_per_step if x == "tokens" else 1

        def xs(steps, scale=scale):
            return [s * scale for s in steps]
        for ax, key in ((ax_loss, "loss"), (ax_norm, "grad_norm"), (ax_tps, "tokens_per_s")):
            steps, v = run.series(key)
            if smooth > 1:
                ax.plot(xs(steps), v, color=c, alpha=0.25, linewidth=0.7)
                v = moving_average(v, smooth)
            ax.plot(xs(steps), v, color=c, linestyle=ls, linewidth=1.4, label=run.label)
        steps, lr = run.series("lr")
        ax_lr.plot(xs(steps), lr, color=c, linestyle=ls, linewidth=1.4, label=run.label)
        if run.val:
            vs = sorted(run.val)
            ax_loss.plot(xs(vs), [run.val[s] for s in vs], color=c, marker="o", markersize=5, linestyle="--",
                         linewidth=1.0, markeredgecolor="black", markeredgewidth=0.5, label=f"{run.label} (val)")
    avg = f", mean of {smooth} steps over the faint raw curve" if smooth > 1 else ""
    ax_loss.set_title(f"loss: train (line{avg}) and val (dots)", fontsize=10)
    ax_loss.set_ylabel("cross-entropy (nats)")
    ax_loss.legend(handles=[Line2D([], [], color="gray", linewidth=1.4, label="train"),
                            Line2D([], [], color="gray", marker="o", linestyle="--", label="val")],
                   loc="upper right", fontsize=8)
    ax_norm.set_title("gradient norm (before clipping)", fontsize=10)
    ax_norm.set_ylim(bottom=0)
    ax_lr.set_title("learning rate", fontsize=10)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_tps.set_title("tokens/s (all ranks)", fontsize=10)
    ax_tps.set_ylim(bottom=0)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("tokens seen" if x == "tokens" else "step")
    fig.legend(handles=[Line2D([], [], color=colors[i % len(colors)], linestyle=STYLES[i % len(STYLES)],
                               linewidth=2.5, label=r.label) for i, r in enumerate(runs)],
               loc="outside upper center", ncol=min(len(runs), 3), fontsize=9, frameon=False,
               title=title, title_fontsize=11)
    return fig


def save(fig, path: str) -> None:
    """Write the figure (format from the file's extension), whole or not at all, and close it."""
    import matplotlib.pyplot as plt

    from .files import atomic_write
    buf = io.BytesIO()
    fig.savefig(buf, format=os.path.splitext(path)[1][1:].lower(), dpi=110)
    plt.close(fig)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as e:
        raise LlmzError(f"{path}: cannot create its folder ({e.strerror or e})") from None
    atomic_write(path, [buf.getvalue()])


def summary_line(run: LogFile) -> str:
    steps, loss = run.series("loss")
    parts = [f"{run.label}: {len(steps)} steps"]
    if loss:
        parts.append(f"loss {loss[0]:.4f} -> {loss[-1]:.4f}")
    if run.val:
        last = max(run.val)
        parts.append(f"val loss {run.val[last]:.4f} at step {last}")
    tps = run.end.get("tokens_per_s")
    if _number(tps):
        parts.append(f"{tps:,.0f} tokens/s")
    if not run.end:
        parts.append("(no end record: the run did not finish)")
    return ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmz.plot", description="Plot the training curves of one or more `python -m llmz.train --log FILE.jsonl` runs into "
        "one figure: train and val loss, gradient norm, learning rate, tokens/s; each run one colour.")
    p.add_argument("logs", nargs="+", metavar="LOG.jsonl", help="--log files of `python -m llmz.train`, one run each (a "
                   "run still going writes its log under its own name, record by record: plot it any time)")
    p.add_argument("-o", "--out", default="curves.png", metavar="FILE",
                   help=f"the figure to write: {', '.join(FORMATS)}, from the extension; its folder is created "
                   "(default curves.png)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="legend name of a run, once per log in the same order (default: the file name and "
                   "the run's ZeRO stage, ranks and precision)")
    p.add_argument("--x", choices=("step", "tokens"), default="step",
                   help="x axis: optimizer steps, or tokens seen (step x B*T*K*ranks, from the start record: "
                   "compares runs whose steps hold different numbers of tokens) (default step)")
    p.add_argument("--smooth", type=int, default=None, metavar="STEPS",
                   help="average the train loss, gradient norm and tokens/s over a centred window of STEPS "
                   "steps, drawn over the faint raw curve (default: about 1/50 of the longest run; 1: raw only)")
    p.add_argument("--title", default=None, help="a title above the legend (default none)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        ext = os.path.splitext(a.out)[1][1:].lower()
        if ext not in FORMATS:
            raise LlmzError(f"-o {a.out}: name a .png, .svg or .pdf file")
        if a.smooth is not None and a.smooth < 1:
            raise LlmzError(f"--smooth must be >= 1 (steps), got {a.smooth}")
        if a.label is not None and len(a.label) != len(a.logs):
            raise LlmzError(f"{len(a.label)} --label for {len(a.logs)} logs: give one per log, or none")
        runs = [read_log(path) for path in a.logs]
        label_runs(runs, a.label)
        if a.x == "tokens":
            missing = [r.path for r in runs if r.tokens_per_step is None]
            if missing:
                raise LlmzError(f"--x tokens: {missing[0]} has no start record with the batch size")
        smooth = a.smooth or auto_window(runs)
        save(figure(runs, a.x, smooth, a.title), a.out)
    except LlmzError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for run in runs:
        print(summary_line(run))
    print(f"wrote {a.out} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
