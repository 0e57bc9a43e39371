"""What every lesson shares: its flags, its runs (built through the library: an llmz.config.TrainConfig and an
llmz.trainer.Trainer), the loop that trains this lesson's run beside the previous lesson's, the checkpoints,
the figures, --diff and --mine.

A lesson trains with its plain version (llmz/plain/, PLAIN below: each ZeRO stage in one screen, blocking
collectives), and beside it llmz.zero's production stage, whose parameters must come out the same, bit for bit;
with --mine FILE it trains with the learner's version instead (an exercise of lessons/exercises/ filled in),
and the same checkpoints grade it. A gap left open (NotImplementedError) stops the lesson at once, with one
line that names it.

A checkpoint compares a measured number with what the lesson's idea predicts, and rank 0 prints both:
    CHECKPOINT 2/4: parameters bit-identical on all 2 ranks: 1 distinct hash (3f2a9c01d4e7) ... PASS
Its verdict is collective (failed on any rank = failed on all), so every rank exits with the same code and
none is left waiting for another. The training itself is llmz's: these helpers only build and compare.

`--diff` prints what a lesson changed from the lesson it builds on, as picotron's tutorial ships each step's
diff: first the mechanism (the unified diff of the two plain versions), then the lesson files.

LLMZ_LESSON_BREAK=skip_all_gather (lessons 02, 03, 05) or skip_all_reduce (lesson 01) removes that collective
from the plain stage the lesson trains, on purpose, to watch the matching checkpoints fail (tests/test_lessons.py
does). At stages 1 and 2 the all-gather after the step is skipped; at stage 3 every all-gather of parameters
leaves each rank with only its own slice (the other ranks' part of the slot keeps whatever it held).
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import os
import socket
import sys
import textwrap
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmz.args import check_kernels, check_train, parse_lesson
from llmz.config import TrainConfig, default_print_every, fmt_bytes
from llmz.device import resolve
from llmz.errors import UsageError
from llmz.run.launch import RankInfo, abort_on_error, agree, init_ranks
from llmz.run.log import zero_on_one_rank
from llmz.trace import overlap, save_png

# Relative tolerance on a loss compared with another way of computing the same step. fp64 (cpu, sim): only
# the order of additions differs, 1e-16 per operation, far below 1e-10. fp32 (gpu): 1e-7 per operation, grown
# a little by each AdamW step (it divides by sqrt(v), so small gradients matter as much as large ones).
LOSS_RTOL = {"fp64": 1e-10, "fp32": 1e-4}
# The model each device runs by default: the lessons' deep and narrow preset (8 layers of 32 channels), or
# on the simulator, which runs every CUDA thread as a Python thread, the 2-layer `tiny` on a few tokens.
DEFAULTS = {"cpu": ("thin", 2, 32), "gpu": ("thin", 4, 32), "sim": ("tiny", 1, 4)}
BREAKS = ("skip_all_gather", "skip_all_reduce")
LESSONS = Path(__file__).parent
# Each lesson's plain version (llmz/plain/<file>.py), what in it the lesson trains with, and its stage's name
PLAIN = {"00_one_device": ("step", "OneDevice", "step"),
         "01_stage0_data_parallel": ("stage0", "Stage0", "stage 0"),
         "02_stage1_optimizer_sharding": ("stage1", "Stage1", "stage 1"),
         "03_stage2_gradient_sharding": ("stage2", "Stage2", "stage 2"),
         "04_stochastic_rounding": ("rounding", "accumulate_shard_bf16", "stochastic rounding"),
         "05_stage3_parameter_sharding": ("stage3", "Stage3", "stage 3")}


def plain_file(lesson: str) -> str:
    """The lesson's plain version: llmz/plain/stage2.py."""
    return f"llmz/plain/{PLAIN[lesson][0]}.py"


def exercise_file(lesson: str) -> str:
    """The lesson's exercise, its plain version with the key lines removed: lessons/exercises/03_stage2.py."""
    return f"lessons/exercises/{lesson[:2]}_{PLAIN[lesson][0]}.py"


# ---- flags ------------------------------------------------------------------------------------------------
def parse(doc: str, argv, steps: int, sim_steps: int, grad_accum: int, steps_help: str, uses: tuple[str, ...]):
    """The lesson's flags (llmz.args.parse_lesson: --device, --steps, --diff and those it `uses`), the
    device resolved (before numba is imported: `sim` needs that) and the defaults of that device filled in."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    a = parse_lesson(argv, name, doc, steps, sim_steps, grad_accum, steps_help, uses)
    if a.diff:
        return a
    try:
        a.kind = resolve(a.device)
    except (ValueError, RuntimeError) as e:      # --device gpu without one: a flag that cannot be met
        raise UsageError(str(e)) from None
    check_kernels(a, a.kind)                     # --kernels and --attention against the device
    a.precision = "fp32" if a.kind == "gpu" else "fp64"
    model, B, T = DEFAULTS[a.kind]
    a.model = a.model or model
    a.batch_size = a.batch_size or B
    a.seq_len = a.seq_len or T
    a.steps = a.steps or (sim_steps if a.kind == "sim" else steps)
    a.print_every = a.print_every or default_print_every(a.steps)
    a.rtol = LOSS_RTOL[a.precision]
    load_plain(a)
    return a


def load_plain(a) -> None:
    """What the lesson trains with (a.plain): its plain version's class (or function), or with --mine FILE the
    learner's. FILE is run from its text, so nothing is written beside it; a file that does not load, or lacks
    what the lesson needs, is one line (a UsageError). a.plain_name says which in the checkpoints' lines."""
    module, what, idea = PLAIN[a.lesson]
    if not getattr(a, "mine", None):
        a.plain = getattr(importlib.import_module(f"llmz.plain.{module}"), what)
        a.plain_name = f"the plain {idea} ({plain_file(a.lesson)})"
        return
    try:
        text = Path(a.mine).read_text()
    except OSError as e:
        raise UsageError(f"--mine {a.mine}: {e.strerror}") from None
    mine = types.ModuleType(f"mine_{module}")
    mine.__file__ = a.mine
    try:
        exec(compile(text, a.mine, "exec"), mine.__dict__)     # noqa: S102  (the learner's file, by request)
    except SyntaxError as e:
        raise UsageError(f"--mine {a.mine} line {e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001  (the learner's module fails to load: one line, where)
        raise UsageError(f"--mine {a.mine}: {type(e).__name__}: {e} ({in_file(e, a.mine)})") from None
    if not callable(getattr(mine, what, None)):
        raise UsageError(f"--mine {a.mine} defines no {what}: start from {exercise_file(a.lesson)}")
    a.plain = getattr(mine, what)
    a.plain_name = f"your {idea} ({a.mine})"


def in_file(e: BaseException, path: str) -> str:
    """Where in `path` exception e was raised ("lessons/exercises/03_stage2.py:42"), or '' if not there."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) ==
              os.path.abspath(path)]
    return f"{path}:{frames[-1].lineno}" if frames else ""


def open_gap(e: NotImplementedError, a) -> str | None:
    """The line that stops a lesson whose --mine file hit a gap it has not filled in: where, and its hint."""
    where = in_file(e, a.mine) if getattr(a, "mine", None) else ""
    return f"{where}: {e} (fill it in, then run the lesson again)" if where else None


def main(lesson, doc: str, argv=None, steps: int = 5, sim_steps: int = 2, grad_accum: int = 2,
         about_ranks: bool = False, steps_help: str = "optimizer steps", builds_on: str | None = None,
         uses: tuple[str, ...] = ("--comm", "--kernels", "--attention", "--model", "--print-every",
                                  "--mine")) -> int:
    """Parse, find my rank, run `lesson(args, ranks)` (it returns the exit code); an exception on any rank
    ends every rank (llmz.run.launch.abort_on_error). The flags are checked on every rank once the ranks are up
    (llmz.run.launch.agree): a bad flag or a device that is not there is one `error:` line and exit 2, as in
    llmz.train. uses: the flags the lesson takes beyond --device, --steps and --diff (llmz.args.LESSON_FLAGS;
    by default those of a lesson that trains and draws nothing). A lesson `about_ranks` (its idea needs
    N > 1) says so when run alone. builds_on: the lesson whose file --diff compares this one with (None: the
    first lesson, or an experiment of its own). A gap of a --mine file is one line and exit 1 on every rank
    (each rank reaches the same gap: the plain code does the same on every rank)."""
    ranks = init_ranks()
    with abort_on_error(ranks):
        a = agree(ranks, lambda: parse(doc, argv, steps, sim_steps, grad_accum, steps_help, uses))
        if a.diff:
            say(ranks, lesson_diff(a.lesson, builds_on), end="")
            return 0
        if about_ranks and ranks.world_size == 1:
            say(ranks, f"note: this lesson is about several ranks, and it runs here as 1 (started without "
                f"mpiexec): nothing is sent, and the checkpoints that compare ranks hold trivially. Run it as\n"
                f"    mpiexec -n 2 python -m lessons.{a.lesson}")
        try:
            code = lesson(a, ranks)
        except NotImplementedError as e:
            line = open_gap(e, a)
            if line is None:
                raise
            say(ranks, line)
            code = 1
    return code


def shown(a, step: int) -> bool:
    """Does step `step` get its line? The first, the last, and every --print-every steps."""
    return step in (0, a.steps - 1) or step % a.print_every == 0


def lesson_diff(name: str, builds_on: str | None) -> str:
    """What lesson `name` changed from lesson `builds_on`: the parts of its plain stage that replace the earlier
    stage's (stage_diff: the mechanism), then the unified diff of the lesson files (what they measure)."""
    if builds_on is None:
        return (f"{name} builds on no earlier lesson (it is the first, or an experiment of its own): read "
                f"{plain_file(name)} and lessons/{name}.py whole\n")
    return stage_diff(builds_on, name) + file_diff(f"lessons/{builds_on}.py", f"lessons/{name}.py")


def stage_diff(before: str, after: str) -> str:
    """Each plain stage is the one before with some parts replaced (a subclass: llmz/plain/step.py's docstring).
    The unified diff of those parts: on the old side each part as lesson `before`'s stage has it (its own, or
    inherited), on the new side lesson `after`'s class as its file writes it."""
    old, new = (getattr(importlib.import_module(f"llmz.plain.{PLAIN[n][0]}"), PLAIN[n][1]) for n in (before, after))
    mine = [k for k, v in vars(new).items() if inspect.isfunction(v)]
    had = [inspect.getsource(getattr(old, k)) for k in mine if inspect.isfunction(getattr(old, k, None))]
    before_text = f"class {old.__name__}({old.__bases__[0].__name__}):\n" + "\n".join(had)
    after_text = inspect.getsource(new)
    return "".join(difflib.unified_diff(before_text.splitlines(keepends=True), after_text.splitlines(keepends=True),
                                        f"{plain_file(before)}: {old.__name__}, the parts {new.__name__} replaces",
                                        f"{plain_file(after)}: {new.__name__}"))


def file_diff(old: str, new: str) -> str:
    """The unified diff of two files of the repository, named by their paths in it."""
    before, after = ((LESSONS.parent / f).read_text().splitlines(keepends=True) for f in (old, new))
    return "".join(difflib.unified_diff(before, after, old, new))


# ---- runs -------------------------------------------------------------------------------------------------
def make_run(a, ranks, stage: int, plain=None, batch_size: int | None = None, comm: str | None = None,
             trace: str | None = None):
    """A run (llmz.trainer.Trainer) of the lesson's device and model at ZeRO `stage` on these ranks, with
    llmz.zero's stage, or with `plain` (a plain stage's class, llmz.plain, or the learner's): a learning rate
    that moves in a few steps, weight decay and clipping switched on so every part of the update runs, no
    validation, fp32 without TF32 on a GPU (the same bits from the same inputs), and every collective launched
    from Python each step, so the communicator's counters count them (a replayed CUDA graph runs the same calls
    without passing through the counters)."""
    from llmz.trainer import Trainer  # numba loads here, after the device is resolved (the simulator)
    from llmz.zero import make_stage
    cfg = TrainConfig(device=a.kind, precision=a.precision, comm=comm or a.comm, kernels=a.kernels,
                      attention=a.attention, no_cuda_graph=True, no_tf32=True, zero_stage=stage, model=a.model,
                      max_seq_len=a.seq_len, seq_len=a.seq_len, batch_size=batch_size or a.batch_size,
                      grad_accum=a.grad_accum, steps=a.steps, lr=1e-2, warmup_steps=2, lr_schedule="constant",
                      weight_decay=0.1, grad_clip=1.0, val_data="", trace=trace, quiet=True)
    check_train(cfg, a.kind, ranks.world_size)
    return Trainer(cfg, a.kind, ranks, make_stage=plain_stage(plain) if plain else make_stage)


def plain_stage(cls):
    """A maker of the plain stage `cls` with llmz.zero.make_stage's signature (the Trainer's): what only the
    production stage has (overlap, the timeline, bf16's seed, a resume's step) it leaves out."""
    def make(stage, layout, dev, comm, opt, params_host, **production_only):
        return cls(layout, dev, comm, opt, params_host)
    return make


def one_rank(ranks):
    """A world of one on this rank's device: with it a run talks to nobody (its communicator is local)."""
    return RankInfo(0, 1, ranks.local_rank, 1, getattr(ranks, "hostname", socket.gethostname()))


def three_runs(a, ranks, stage: int, previous, figure: str):
    """The runs a sharding lesson compares: the previous lesson's plain stage (`previous`, at stage - 1: the
    reference), this lesson's plain stage (a.plain: the one the checkpoints grade, with --break applied) and
    llmz.zero's production stage, traced into `figure`'s JSON. Says the setup; returns (trace, ref, run,
    prod)."""
    trace = figure_name(a, ranks, figure, ext="json", with_k=True)
    ref = make_run(a, ranks, stage=stage - 1, plain=previous)
    run = make_run(a, ranks, stage=stage, plain=a.plain)
    prod = make_run(a, ranks, stage=stage, trace=trace)
    apply_break(run.zero)
    say_setup(a, ranks, run)
    return trace, ref, run, prod


def apply_break(stage) -> None:
    """LLMZ_LESSON_BREAK: remove one collective from a plain stage on purpose (see the module docstring). The
    stage's communicator (llmz.plain.base.Blocking) stops doing it: an all-reduce at stage 0 (the gradients'),
    an all-gather at any stage (a block's or the step's), which leaves each rank with its own slice only."""
    what = os.environ.get("LLMZ_LESSON_BREAK", "")
    if what and what not in BREAKS:
        raise SystemExit(f"LLMZ_LESSON_BREAK={what}: choose one of {', '.join(BREAKS)}")
    comm = stage.comm.comm                              # Blocking's: the run's Communicator

    def no_gather(buf, src=None) -> None:               # my slice in its place; the others' stay stale
        if src is not None:
            comm.place(buf, src)
    if what == "skip_all_gather":
        stage.comm.all_gather = no_gather
    if what == "skip_all_reduce":
        stage.comm.all_reduce = lambda buf, op="sum": None


def say_setup(a, ranks, run) -> None:
    """The lesson's first line: ranks, device, precision, communicator, the model and the batch."""
    c = run.model.config
    say(ranks, f"{n_ranks(ranks.world_size)} on {run.dev.kind} ({a.precision}), comm {run.comm.name}: "
        f"L={c.num_layers} C={c.channels} B={a.batch_size} T={a.seq_len} K={a.grad_accum}, "
        f"Ψ = {run.layout.num_parameters:,} parameters")


@dataclass
class Steps:
    """What side_by_side measured, one entry a step."""
    losses: list = field(default_factory=list)          # this lesson's run
    ref_losses: list = field(default_factory=list)      # the run it is compared with (empty where none ran)
    norms: list = field(default_factory=list)           # the gradient norms of this lesson's run
    ref_norms: list = field(default_factory=list)       # and of the reference
    sent: list = field(default_factory=list)            # bytes this lesson's run sent (llmz.comm's count)
    ref_sent: list = field(default_factory=list)
    calls: list = field(default_factory=list)           # the collectives it ran: {name: count}
    measured: list = field(default_factory=list)        # `measure` over its step
    events: list = field(default_factory=list)          # the traced step's timeline (rank 0)


def side_by_side(a, ranks, run, ref, names: tuple[str, str], prod=None, trace: str | None = None,
                 measure=None) -> Steps:
    """Train `run` (this lesson's, with its plain stage) beside `ref` (the previous lesson's way, or a one-process
    reference; None on a rank that does not run it) and `prod` (llmz.zero's stage of this lesson, for the same
    bits) for a.steps steps, a line a step (every --print-every steps: `shown`); names: how the lines call run
    and ref. measure: (label, fn): fn(run) before and after each step of run, its growth recorded (an int: the
    difference; a list: what was appended). trace: rank 0 records the timeline of prod's second step there."""
    out = Steps()
    traced = min(1, a.steps - 1)
    for step in range(a.steps):
        if ref:
            ref.comm.reset_counters()
            done = ref.step(step)
            out.ref_losses.append(done["loss"])
            out.ref_norms.append(done["grad_norm"])
            out.ref_sent.append(ref.comm.bytes_sent)
        if prod:
            recording = trace and step == traced and ranks.rank == 0
            if recording:
                prod.tracer.start()
            prod.step(step)
            if recording:
                out.events = prod.tracer.stop(trace)["traceEvents"]
        run.comm.reset_counters()
        before = measure[1](run) if measure else 0
        done = run.step(step)
        out.losses.append(done["loss"])
        out.norms.append(done["grad_norm"])
        if measure:
            after = measure[1](run)
            out.measured.append(after[len(before):] if isinstance(after, list) else after - before)
        out.sent.append(run.comm.bytes_sent)
        out.calls.append(run.comm.calls.copy())
        if not shown(a, step):
            continue
        line = f"step {step}: {names[0]} loss {out.losses[-1]:.10f} norm {out.norms[-1]:.6f}"
        if ref:
            line += f" | {names[1]} loss {out.ref_losses[-1]:.10f} norm {out.ref_norms[-1]:.6f}"
        if measure:
            m = out.measured[-1]
            line += f" | {len(m) if isinstance(m, list) else m} {measure[0]}"
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(out.calls[-1].items()))
        say(ranks, line + f" | sent {out.sent[-1]:,} B ({calls})")
    return out


# ---- checkpoints ------------------------------------------------------------------------------------------
def check_same_losses(ck, a, steps: Steps, claim: str, across_ranks: bool = False) -> bool:
    """Checkpoint: this lesson's losses and gradient norms equal the reference's, step by step, within a.rtol
    (the norm: a gradient summed where its mean belongs, or normed over a part only, shows there even where
    clipping hides it from the parameters). claim: what is compared ("losses and gradient norms of stage 1 =
    stage 0's over 5 steps"). Where no reference ran, this rank agrees."""
    if not steps.ref_losses:
        return ck.check(True, "", across_ranks=across_ranks)      # rank 0's verdict is the check's
    d_loss = max_rel_diff(steps.losses, steps.ref_losses)
    d_norm = max_rel_diff(steps.norms, steps.ref_norms)
    return ck.check(max(d_loss, d_norm) <= a.rtol,
                    f"{claim}: loss {steps.losses[-1]:.10f} vs {steps.ref_losses[-1]:.10f}, gradient norm "
                    f"{steps.norms[-1]:.6f} vs {steps.ref_norms[-1]:.6f} at the last (worst relative difference "
                    f"{d_loss:.1e} in the losses, {d_norm:.1e} in the norms, expected <= {a.rtol:.0e})",
                    across_ranks=across_ranks)


def check_same_as_production(ck, a, ranks, run, prod, what: str) -> bool:
    """Checkpoint: the code this lesson trained with (its plain version, or --mine's) ends with the same
    parameters as llmz.zero's stage trained beside it, bit for bit, on every rank: the code the lesson shows is
    the code that trains. Both go through the same Communicator, so MPI sums every element in the same order
    (llmz.comm: a blocking reduce-scatter is the non-blocking one, waited for)."""
    same = same_bits(ranks, run, prod)
    return ck.check(all(same), f"{a.plain_name} = llmz.zero's {what}, bit for bit: the parameters after "
                    f"{a.steps} steps equal on {sum(same)} of {n_ranks(ranks.world_size)}, expected all")


def check_sharded(ck, run, ref, category: str, ref_name: str) -> bool:
    """Checkpoint: this rank's `category` bytes (gradients at stage 2, also parameters at stage 3) are its
    shard of every bucket, two block slots, and the embeddings and the final layernorm whole, exactly; said
    beside the reference run's (which keeps them all)."""
    lay, b = run.layout, run.dev.dtype.itemsize
    slot = max(bk.padded_size for bk in lay.buckets[1:-1])
    parts = {"shard": lay.shard_total, "two slots": 2 * slot, "embeddings": lay.embeddings.padded_size,
             "lnf": lay.lnf.padded_size}
    full, mine = ref.memory["measured"][category], run.memory["measured"][category]
    return ck.check(mine == b * sum(parts.values()), f"{category} per rank {fmt_bytes(mine)} = "
                    + " + ".join(f"{k} {fmt_bytes(b * v)}" for k, v in parts.items())
                    + f" (expected exactly), vs {ref_name}'s full {fmt_bytes(full)}: {mine / full:.2f}x")


def count_in_micro_steps(run, name: str):
    """Count the `name` collectives (llmz.comm's calls) that run's micro-steps (forward and backward) make, not
    its update; returns the count so far as a function of the run (side_by_side's `measure`)."""
    counted = {"n": 0}
    micro_step = run.micro_step

    def counting() -> None:
        before = run.comm.calls[name]
        micro_step()
        counted["n"] += run.comm.calls[name] - before
    run.micro_step = counting
    return lambda r: counted["n"]


def sent_as_predicted(ranks, sent: list, expect: int) -> tuple[int, bool]:
    """(the most bytes any rank sent in a step, whether that is `expect` within 0.5%; one rank: nothing)."""
    worst = max(gather(ranks, max(sent)))
    return worst, (abs(worst - expect) <= 0.005 * expect if ranks.world_size > 1 else worst == 0)


def same_bits(ranks, run, other) -> list[bool]:
    """On every rank: do these two runs hold the same parameter bits?"""
    return gather(ranks, params_hash(run) == params_hash(other))


def check_overlap(ck, ranks, run, events: list, share: str, started: str, gpu: str, exposed: str) -> bool:
    """Checkpoint: in the traced step (rank 0's timeline, llmz.trace.overlap) a layer computed during part of
    the time collectives were in flight: communication hidden behind compute. The expected share (CPU ranks) and
    why, in the lesson's words: `started` says which collective starts before which layer, `gpu` what the comm
    stream runs beside the compute stream, `exposed` what cannot hide. With one rank nothing is sent, so nothing
    is ever in flight: trivial."""
    if ranks.world_size == 1:
        return ck.check(True, "overlap: nothing is sent with 1 rank, so no collective is ever in flight",
                        across_ranks=True)
    if ranks.rank != 0:                                 # rank 0 traced the step; its verdict is the check's
        return ck.check(True, "")
    m = overlap(events)
    why = (f"most of it: the comm stream runs {gpu}; exposed: {exposed}" if run.dev.kind == "gpu" else
           f"about {share} for thin on 2 idle CPU cores (less on busy ones): {started}, and MPICH needs 2+ MPI "
           f"calls after the start to finish it, one made before the next layer computes, so it is in flight "
           f"through that layer; exposed: the MPI calls (where MPICH copies and adds) and other host work "
           f"between layers, {exposed}")
    return ck.check(m.hidden_ms > 0, f"overlap in the traced step, {run.dev.kind} (rank 0): {m}; expected > 0, "
                    f"{why}")


# ---- across ranks -----------------------------------------------------------------------------------------
def gather(ranks, obj) -> list:
    """Every rank's obj, on every rank (MPI carries checkpoint values, whatever --comm moves gradients)."""
    return ranks.allgather(obj)                # under the collective watchdog (llmz.run.watchdog)


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


def say(ranks, *args, end: str = "\n") -> None:
    if ranks.rank == 0:
        print(*args, end=end, flush=True)


class Checks:
    """A lesson's checkpoints, numbered: `check(ok, text)` on every rank, in the same order; rank 0 prints. A check that
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
def one_rank_note(stages) -> str:
    """The words under the memory chart of a one-rank run (whose ZeRO `stages` are drawn), where the later
    stages hold more than stage 0, not less."""
    three = "; stage 3 the same again for the parameters" if 3 in stages else ""
    return ("1 rank: every shard is the whole buffer, so no stage divides anything. Stage 2 adds two gradient "
            f"slots and the embedding and lnf gradients beside its whole gradient shard{three}. Run it under "
            "mpiexec -n 2 to see the bars shrink.")


def plot_memory(reports: dict[str, dict], path: str, title: str, note: str | None = None) -> None:
    """Stacked bars of the bytes one rank holds, by category, one bar per stage (measured: llmz.memory)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_png(memory_figure(reports, title, note), path)


def memory_figure(reports: dict[str, dict], title: str, note: str | None = None):
    """plot_memory's figure: each bar's total above it, the legend beside the bars in the order of the stack,
    `note` under the bars. (matplotlib, heavy to import, only for the lessons that draw.)"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats = ("parameters", "gradients", "optimizer_state", "activations")
    names = list(reports)
    top = max(sum(r["measured"][c] for c in cats) for r in reports.values())
    unit, scale = ("MiB", 2**20) if top >= 2**20 else ("KiB", 2**10)
    fig, ax = plt.subplots(figsize=(7.5, 4.6 if note else 4))
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
    if note:
        ax.set_xlabel(textwrap.fill(note, 95), fontsize=8, loc="left", labelpad=8)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def stages_memory_chart(a, ranks, built: dict, earlier: dict, figure: str) -> None:
    """memory_chart of ZeRO stages side by side, one bar a stage: the runs the lesson built ({label: run}) and
    the earlier stages' plain stages ({label: (stage, plain class)}), built here for their memory reports only;
    titled with the model, the ranks and Ψ."""
    runs = {label: make_run(a, ranks, stage=stage, plain=plain) for label, (stage, plain) in earlier.items()}
    run = next(iter(built.values()))
    memory_chart(a, ranks, {**runs, **built}, figure_name(a, ranks, figure),
                 f"memory per rank: {a.model}, {n_ranks(ranks.world_size)}, {run.layout.num_parameters:,} "
                 f"parameters ({a.precision})")


def memory_chart(a, ranks, runs: dict, path: str, title: str) -> None:
    """Rank 0 draws plot_memory's chart of these runs' memory reports ({label: run}) into path. With one rank
    it says, on the chart and in a line per stage (llmz.run.log.zero_on_one_rank), why the later stages hold
    more than stage 0."""
    if ranks.rank != 0:
        return
    note = None
    if ranks.world_size == 1:
        note = one_rank_note([run.cfg.zero_stage for run in runs.values()])
        for run in runs.values():
            line = zero_on_one_rank(run.layout, run.cfg.zero_stage, run.precision.value_bytes)
            if line:
                say(ranks, line)
    plot_memory({label: run.memory for label, run in runs.items()}, path, title, note)
    say(ranks, f"wrote {path}")


def figure_name(a, ranks, what: str, ext: str = "png", with_k: bool = False) -> str:
    """A lesson's output file in --out, named by the settings that change it (model, ranks, and K micro-steps
    where they matter), so runs with other settings keep theirs:
    lessons_out/memory_per_rank_thin_2ranks.png, lessons_out/stage2_timeline_thin_2ranks_k3.json."""
    k = f"_k{a.grad_accum}" if with_k else ""
    return os.path.join(a.out, f"{what}_{a.model}_{ranks.world_size}ranks{k}.{ext}")


if __name__ == "__main__":
    sys.exit("lessons.common holds the lessons' helpers; run a lesson, e.g. python -m lessons.00_one_device")
