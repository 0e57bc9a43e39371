"""Why ZeRO-2's captured step hung, and that it no longer does (a GPU probe; BENCHMARKS.md has its table).

    python tools/graph_probe.py --all            # every variant below, each in its own process, a table last
    python tools/graph_probe.py --all --fixed-only   # the code as it is, stages 2 and 3
    python tools/graph_probe.py --variant fixed --comm nccl --precision bf16

One variant: a small GPT-2 at ZeRO stage 2 (or 3: --stage 3, its micro-step also gathers every block twice),
one rank, trained 4 steps with the step captured as CUDA graphs
and the same 4 steps eagerly (--no-cuda-graph), from the same start; prints both loss sequences and whether
they are bit-identical. A replay that does not finish within --timeout seconds prints where the host waits
(faulthandler) and exits 3: the hang. The variants put back, one at a time, what the stage-2 code did before:
  fixed            the code as it is now
  old-reduce-wait  the sharded gradient store's reduce() (the update's first call) waits on an event recorded
                   on the comm stream, which at that point of the update is idle and outside the capture
  per-call-events  a new CUDA event for every record/wait pair (comm_waits_for_compute, the slot events)
  old              both
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import subprocess
import sys
import tempfile

import numpy as np

VARIANTS = ("fixed", "old-reduce-wait", "per-call-events", "old")


def patch(variant: str) -> None:
    from llmz.zero.context import Context
    from llmz.zero.grads import ShardedGradients
    if variant in ("old-reduce-wait", "old"):
        ShardedGradients.reduce = lambda self: self.ctx.compute_waits_for_comm()
    if variant in ("per-call-events", "old"):
        def comm_waits_for_compute(self):
            e = self.dev.event()
            e.record(self.dev.compute_stream)
            e.wait(self.dev.comm_stream)

        def compute_waits_for_comm(self):
            e = self.dev.event()
            e.record(self.dev.comm_stream)
            e.wait(self.dev.compute_stream)
        done = ShardedGradients.done

        def fresh_done(self, b):
            self.free[self.buffer_of[b]] = self.ctx.dev.event()
            done(self, b)
        Context.comm_waits_for_compute = comm_waits_for_compute
        Context.compute_waits_for_comm = compute_waits_for_comm
        ShardedGradients.done = fresh_done


def losses(flags: list[str], steps: int) -> tuple[list[float], str]:
    from llmz.run.launch import init_ranks
    from llmz.train import parse_args
    from llmz.trainer import Trainer
    args, kind = parse_args(flags)
    run = Trainer(args, kind, init_ranks())
    out = []
    for i in range(steps):
        out.append(run.step(i)["loss"])
        print(f"    step {i}: loss {out[-1]!r} (graphs {'on' if run.graphs.enabled else 'off'})", flush=True)
    digest = f"{hash(run.host_params().tobytes()) & 0xFFFFFFFF:08x}"
    run.comm.close()
    return out, digest


def one(a) -> int:
    patch(a.variant)
    faulthandler.dump_traceback_later(a.timeout, exit=True)      # a hang: where the host waits, then exit
    with tempfile.TemporaryDirectory() as tmp:
        from llmz.data import write_tokens
        path = os.path.join(tmp, "tokens.bin")
        write_tokens(path, np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.int64))
        flags = ["--device", "gpu", "--model", a.model, "-b", "4", "-t", "128", "--zero-stage", str(a.stage),
                 "--comm", a.comm, "--precision", a.precision, "--grad-accum", str(a.grad_accum),
                 "--train-data", path, "--val-data", "", "--steps", "4", "--lr", "1e-3", "--warmup-steps", "0",
                 "--quiet", "--no-tf32"]
        print(f"  {a.variant} stage {a.stage} {a.comm} {a.precision} K={a.grad_accum}: graphed", flush=True)
        g, gd = losses(flags, 4)
        print(f"  {a.variant} stage {a.stage} {a.comm} {a.precision} K={a.grad_accum}: eager", flush=True)
        e, ed = losses(flags + ["--no-cuda-graph"], 4)
    same = g == e and gd == ed
    print(f"RESULT {a.variant} stage {a.stage} {a.comm} {a.precision} K={a.grad_accum}: "
          f"{'bit-identical' if same else 'DIFFERENT'} losses and parameters (graphed {gd}, eager {ed})")
    return 0 if same else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true")
    p.add_argument("--fixed-only", action="store_true", help="with --all: only the code as it is now")
    p.add_argument("--variant", choices=VARIANTS, default="fixed")
    p.add_argument("--comm", choices=("auto", "nccl"), default="nccl", help="auto: one rank, the local communicator")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage (3 reuses stage 2's graph)")
    p.add_argument("--model", default="d2")
    p.add_argument("--timeout", type=float, default=60)
    a = p.parse_args()
    if not a.all:
        return one(a)
    cases = [(2, v, c, pr) for v in VARIANTS for c, pr in (("nccl", "fp32"), ("auto", "fp32"), ("nccl", "bf16"))
             if v == "fixed" or pr == "fp32"] if not a.fixed_only else []
    cases += [(3, "fixed", c, pr) for c, pr in (("nccl", "fp32"), ("auto", "fp32"), ("nccl", "bf16"))]
    rows = []
    for stage, v, c, pr in cases:
        cmd = [sys.executable, __file__, "--variant", v, "--comm", c, "--precision", pr, "--stage", str(stage),
               "--grad-accum", str(a.grad_accum), "--model", a.model, "--timeout", str(a.timeout)]
        if c == "nccl":             # one rank under the launcher, as llmz.train runs it (OpenMPI: as root)
            cmd = ["mpiexec", "--allow-run-as-root", "-n", "1"] + cmd
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=a.timeout + 120)
        text = r.stdout + r.stderr
        print(text[-1500:], flush=True)
        result = next((ln for ln in text.splitlines() if ln.startswith("RESULT")), None)
        hung = "Timeout (0:" in text
        rows.append((stage, v, c, pr, "HUNG" if hung else "ok" if r.returncode == 0 else f"rc {r.returncode}",
                     result or text.strip().splitlines()[-1][:100] if text.strip() else ""))
    print("stage variant           comm   prec  outcome  detail")
    for stage, v, c, pr, outcome, detail in rows:
        print(f"{stage:<5} {v:<17} {c:<6} {pr:<5} {outcome:<8} {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
