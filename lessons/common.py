"""What every lesson shares: its flags, building an llmz.train.Run, and the checkpoints.

A checkpoint compares a measured number with what the lesson's idea predicts, and rank 0 prints both:
    CHECKPOINT 2/4: parameters bit-identical on all 2 ranks: 1 distinct hash (3f2a9c01d4e7) ... PASS
Its verdict is collective (failed on any rank = failed on all), so every rank exits with the same code and
none is left waiting for another. The training itself is llmz's: these helpers only build and compare.

LLMZ_LESSON_BREAK=skip_all_gather (lessons 02, 03, 05) or skip_all_reduce (lesson 01) removes that collective
on purpose, to watch the matching checkpoints fail (tests/test_lessons.py does). At stages 1 and 2 the
all-gather after the step is skipped; at stage 3 every all-gather of parameters leaves each rank with only
its own slice (the other ranks' part of the slot keeps whatever it held).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys

import numpy as np

from llmz.device import ATTENTIONS, KERNEL_SETS, KINDS, resolve
from llmz.errors import UsageError
from llmz.launch import allgather

# Relative tolerance on a loss compared with another way of computing the same step. fp64 (cpu, sim): only
# the order of additions differs, 1e-16 per operation, far below 1e-10. fp32 (gpu): 1e-7 per operation, grown
# a little by each AdamW step (it divides by sqrt(v), so small gradients matter as much as large ones).
LOSS_RTOL = {"fp64": 1e-10, "fp32": 1e-4}
# The model each device runs by default: the lessons' deep and narrow preset (8 layers of 32 channels), or
# on the simulator, which runs every CUDA thread as a Python thread, the 2-layer `tiny` on a few tokens.
DEFAULTS = {"cpu": ("thin", 2, 32), "gpu": ("thin", 4, 32), "sim": ("tiny", 1, 4)}
BREAKS = ("skip_all_gather", "skip_all_reduce")


# ---- flags ------------------------------------------------------------------------------------------------
def parse(doc: str, argv, steps: int, sim_steps: int, grad_accum: int | None = None,
          steps_help: str = "optimizer steps") -> argparse.Namespace:
    """The lesson's flags; also resolves the device (before numba is imported: `sim` needs that)."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    from llmz.args import Parser, check_lesson  # one-line errors, defaults in --help
    p = Parser(prog=f"python -m lessons.{name}", description=doc.split("\n\n")[0],
               epilog=f"N ranks: mpiexec -n N python -m lessons.{name}. lessons/README.md says what "
               "each checkpoint measures.")
    p.add_argument("--device", choices=KINDS, default="auto",
                   help="default auto: gpu where CuPy sees one, else cpu (NumPy, fp64); sim: the CUDA simulator")
    p.add_argument("--comm", choices=("auto", "nccl", "mpi"), default="auto",
                   help="as in llmz.train (default auto: NCCL with a GPU per rank, else MPI)")
    p.add_argument("--kernels", choices=KERNEL_SETS, default="auto",
                   help="as in llmz.train (default auto: fast, llmz/fast/, on a GPU; teaching, llmz/kernels/, "
                   "elsewhere)")
    p.add_argument("--attention", choices=ATTENTIONS, default="auto",
                   help="as in llmz.train (default auto: on a GPU flash in bf16, gemm in fp32; direct elsewhere; flash: "
                   "FlashAttention-2)")
    p.add_argument("--steps", type=int, default=None, help=f"{steps_help} (default {steps}; {sim_steps} on sim)")
    p.add_argument("--model", default=None, help="a preset of llmz.config (default thin; tiny on sim)")
    p.add_argument("--batch-size", "-b", type=int, default=None, help="B per rank (default 2; 4 on gpu, 1 on sim)")
    p.add_argument("--seq-len", "-t", type=int, default=None,
                   help="T, also the model's max_seq_len (default 32; 4 on sim)")
    if grad_accum is not None:
        p.add_argument("--grad-accum", type=int, default=grad_accum,
                       help=f"K micro-steps per step (default {grad_accum})")
    p.add_argument("--out", default="lessons_out",
                   help="where figures go, named by model, ranks and K (default lessons_out)")
    a = p.parse_args(argv)
    a.lesson = name
    check_lesson(a)                    # one line for a bad flag, on every rank (main calls this under the ranks)
    try:
        a.kind = resolve(a.device)
    except (ValueError, RuntimeError) as e:      # --device gpu without one: a flag that cannot be met
        raise UsageError(str(e)) from None
    from llmz.args import check_kernels
    check_kernels(a, a.kind)                     # --kernels and --attention against the device
    a.precision = "fp32" if a.kind == "gpu" else "fp64"
    model, B, T = DEFAULTS[a.kind]
    a.model = a.model or model
    a.batch_size = a.batch_size or B
    a.seq_len = a.seq_len or T
    a.steps = a.steps or (sim_steps if a.kind == "sim" else steps)
    a.grad_accum = getattr(a, "grad_accum", 1)
    a.rtol = LOSS_RTOL[a.precision]
    return a


def main(lesson, doc: str, argv=None, steps: int = 5, sim_steps: int = 2, grad_accum: int | None = None,
         about_ranks: bool = False, steps_help: str = "optimizer steps") -> int:
    """Parse, find my rank, run `lesson(args, ranks)` (it returns the exit code); an exception on any rank
    ends every rank (llmz.launch.abort_on_error). The flags are checked on every rank once the ranks are up
    (llmz.launch.agree): a bad flag or a device that is not there is one `error:` line and exit 2, as in
    llmz.train. A lesson `about_ranks` (its idea needs N > 1) says so when run alone."""
    from llmz.launch import abort_on_error, agree, init_ranks
    ranks = init_ranks()
    with abort_on_error(ranks):
        a = agree(ranks, lambda: parse(doc, argv, steps, sim_steps, grad_accum, steps_help))
        if about_ranks and ranks.world_size == 1:
            say(ranks, f"note: this lesson is about several ranks, and it runs here as 1 (started without "
                f"mpiexec): nothing is sent, and the checkpoints that compare ranks hold trivially. Run it as\n"
                f"    mpiexec -n 2 python -m lessons.{a.lesson}")
        code = lesson(a, ranks)
    return code


# ---- building runs ----------------------------------------------------------------------------------------
def train_flags(a, stage: int, batch_size: int | None = None, comm: str | None = None,
                trace: str | None = None, overlap: bool = True) -> list[str]:
    """The llmz.train flags of a lesson's run: its device and model, a learning rate that moves in a few
    steps, weight decay and clipping switched on so every part of the update runs, no validation."""
    f = ["--device", a.kind, "--precision", a.precision, "--comm", comm or a.comm, "--zero-stage", str(stage),
         "--kernels", getattr(a, "kernels", "auto"), "--attention", getattr(a, "attention", "auto"),
         "--model", a.model, "--max-seq-len", str(a.seq_len), "-t", str(a.seq_len),
         "-b", str(batch_size or a.batch_size), "--grad-accum", str(a.grad_accum), "--steps", str(a.steps),
         "--lr", "1e-2", "--warmup-steps", "2", "--lr-schedule", "constant", "--weight-decay", "0.1",
         "--grad-clip", "1.0", "--val-data", "", "--quiet",
         # every collective launched from Python each step, so the communicator's counters count them
         # (a replayed CUDA graph runs the same calls without passing through the counters)
         "--no-cuda-graph"]
    if trace:
        f += ["--trace", trace]
    if not overlap:
        f += ["--no-overlap"]
    return f


def make_run(a, ranks, stage: int, **kw):
    """An llmz.train.Run (device, communicator, data, model, ZeRO stage) for these ranks."""
    from llmz.train import Run, parse_args
    args, kind = parse_args(train_flags(a, stage, **kw), kind=a.kind)
    return Run(args, kind, ranks)


def one_rank(ranks):
    """A world of one on this rank's device: with it a Run talks to nobody (its communicator is local)."""
    from llmz.launch import RankInfo
    return RankInfo(0, 1, ranks.local_rank, 1, getattr(ranks, "hostname", socket.gethostname()))


def apply_break(stage) -> None:
    """LLMZ_LESSON_BREAK: remove one collective from a ZeRO stage on purpose (see the module docstring)."""
    what = os.environ.get("LLMZ_LESSON_BREAK", "")
    if what and what not in BREAKS:
        raise SystemExit(f"LLMZ_LESSON_BREAK={what}: choose one of {', '.join(BREAKS)}")
    if what == "skip_all_gather" and stage.stage == 3:
        comm = stage.comm
        comm.all_gather = lambda buf, src=None: src is not None and comm.place(buf, src)
    elif what == "skip_all_gather":
        stage.gather_parameters = lambda: None
    if what == "skip_all_reduce":
        stage.reduce_gradients = lambda: None


# ---- across ranks -----------------------------------------------------------------------------------------
def gather(ranks, obj) -> list:
    """Every rank's obj, on every rank (MPI carries checkpoint values, whatever --comm moves gradients)."""
    return allgather(ranks, obj)                # under the collective watchdog (llmz.watchdog)


def params_hash(run) -> str:
    """A short fingerprint of this rank's full parameters: equal hashes = the same bits."""
    return hashlib.sha256(np.ascontiguousarray(run.host_params()).tobytes()).hexdigest()[:12]


def check_params_identical(ck, ranks, run) -> bool:
    """The checkpoint every ZeRO lesson ends with: all ranks hold the same parameter bits."""
    hashes = set(gather(ranks, params_hash(run)))
    return ck.check(len(hashes) == 1, f"parameters bit-identical on {n_ranks(ranks.world_size)}: {len(hashes)} "
                    f"distinct hash(es) ({', '.join(sorted(hashes))}), expected 1", across_ranks=True)


def max_rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def n_ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def say(ranks, *args) -> None:
    if ranks.rank == 0:
        print(*args, flush=True)


class Checkpoints:
    """Numbered checks: `check(ok, text)` on every rank, in the same order; rank 0 prints. A check that
    compares ranks (`across_ranks=True`) says so when there is one rank only: it holds trivially."""

    def __init__(self, ranks, total: int):
        self.ranks, self.total, self.done, self.failed, self.trivial = ranks, total, 0, 0, 0

    def check(self, ok: bool, text: str, across_ranks: bool = False) -> bool:
        ok = all(gather(self.ranks, bool(ok)))          # collective: failed anywhere = failed everywhere
        self.done += 1
        if across_ranks and self.ranks.world_size == 1:
            text += " [trivial with 1 rank]"
            self.trivial += 1
        say(self.ranks, f"CHECKPOINT {self.done}/{self.total}: {text} ... {'PASS' if ok else 'FAIL'}")
        self.failed += not ok
        return ok

    def exit_code(self) -> int:
        assert self.done == self.total, f"the lesson announced {self.total} checkpoints and ran {self.done}"
        trivial = (f" ({self.trivial} of them trivially, with 1 rank: run the lesson under mpiexec -n 2 to "
                   f"test them)") if self.trivial else ""
        say(self.ranks, f"{self.total - self.failed} of {self.total} checkpoints passed{trivial}")
        return 1 if self.failed else 0


# ---- figures ----------------------------------------------------------------------------------------------
def plot_memory(reports: dict[str, dict], path: str, title: str) -> None:
    """Stacked bars of the bytes one rank holds, by category, one bar per stage (measured: llmz.memory)."""
    from llmz.trace import save_png
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_png(memory_figure(reports, title), path)


def memory_figure(reports: dict[str, dict], title: str):
    """plot_memory's figure: each bar's total above it, the legend beside the bars in the order of the stack."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats = ("parameters", "gradients", "optimizer_state", "activations")
    names = list(reports)
    top = max(sum(r["measured"][c] for c in cats) for r in reports.values())
    unit, scale = ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    bottom = np.zeros(len(names))
    for c in cats:
        v = np.array([reports[n]["measured"][c] for n in names]) / scale
        ax.bar(names, v, bottom=bottom, label=c.replace("_", " "), edgecolor="black", linewidth=0.5)
        bottom += v
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:.2f} {unit}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.1 * bottom.max())
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def figure_name(a, ranks, what: str, ext: str = "png", with_k: bool = False) -> str:
    """A lesson's output file in --out, named by the settings that change it (model, ranks, and K micro-steps
    where they matter), so runs with other settings keep theirs:
    lessons_out/memory_per_rank_thin_2ranks.png, lessons_out/stage2_timeline_thin_2ranks_k3.json."""
    k = f"_k{a.grad_accum}" if with_k else ""
    return os.path.join(a.out, f"{what}_{a.model}_{ranks.world_size}ranks{k}.{ext}")


if __name__ == "__main__":
    sys.exit("lessons.common holds the lessons' helpers; run a lesson, e.g. python -m lessons.00_one_device")
