"""What the overlap of ZeRO-2/3 on CPU ranks buys: the same run overlapped and with --no-overlap, step by step.

    mpiexec -n 2 python tools/overlap_steps.py [--model thin] [-b 2] [-t 32] [-k 2] [--stage 2] [--steps 40]
                                               [--precision fp32]

Builds two runs (llmz.trainer.Trainer, --comm mpi) in each rank's process, one overlapped and one with
--no-overlap, and alternates their steps so that both see the same machine. Rank 0 prints, for each, the median
and 10th percentile ms/step (the first 3 steps left out), the host time spent inside the collectives per step
(starting them, progress() and waiting; llmz/comm.py), and the overlap of the traced step 2 (llmz.trace.overlap).
BENCHMARKS.md ("Overlap on CPU ranks") keeps the figures.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmz import comm
from llmz.config import TrainConfig
from llmz.run.launch import init_ranks

inside = [0.0]          # seconds inside the collectives' calls since the last reset


def timed(f):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0
    return call


for name in ("start_reduce_scatter", "start_all_gather", "progress", "wait_for"):
    owner = comm.MpiCommunicator if hasattr(comm.MpiCommunicator, name) else comm.Communicator
    setattr(owner, name, timed(getattr(owner, name)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="thin")
    p.add_argument("-b", type=int, default=2)
    p.add_argument("-t", type=int, default=32)
    p.add_argument("-k", type=int, default=2, help="micro-steps per step")
    p.add_argument("--stage", type=int, default=2, choices=(2, 3))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp64", "bf16"))
    a = p.parse_args()
    ranks = init_ranks()
    from llmz.trainer import Trainer  # numba loads here, as in the lessons
    runs = {}
    for label, overlap in (("overlapped", True), ("--no-overlap", False)):
        cfg = TrainConfig(device="cpu", precision=a.precision, comm="mpi", zero_stage=a.stage, no_overlap=not overlap,
                          model=a.model, max_seq_len=a.t, seq_len=a.t, batch_size=a.b, grad_accum=a.k,
                          steps=a.steps, val_data="", trace="overlap_steps.json", quiet=True).for_device("cpu")
        runs[label] = Trainer(cfg, "cpu", ranks)
    ms = {label: [] for label in runs}
    host = {label: [] for label in runs}
    traced = {}
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(a.steps):
            for label, run in runs.items():
                inside[0] = 0.0
                trace = f"{tmp}/{label.strip('-')}.json" if step == 2 else None
                _, seconds = run.timed_step(step, trace=trace)
                if trace:
                    traced[label] = run.tracer.measured
                if step >= 3:
                    ms[label].append(seconds * 1e3)
                    host[label].append(inside[0] * 1e3)
    if ranks.rank == 0:
        print(f"{a.model} {a.precision} B={a.b} T={a.t} K={a.k}, stage {a.stage}, {ranks.world_size} ranks: "
              f"{a.steps - 3} steps each, alternating")
        for label in runs:
            print(f"  {label:12s} {np.median(ms[label]):8.2f} ms/step (p10 {np.percentile(ms[label], 10):8.2f}) | "
                  f"in the collectives' calls {np.median(host[label]):6.2f} ms | traced: {traced[label]}")


if __name__ == "__main__":
    main()
