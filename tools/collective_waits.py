"""Measure the longest legitimate waits in collectives: what --collective-timeout's default must exceed.

    mpiexec -n 2 python tools/collective_waits.py [llmz.train's flags]

Runs llmz.train with its flags, timing every collective from the moment this rank enters it to the moment it
completes (MPI: the non-blocking call's wait; NCCL: the event after it, seen by the watchdog thread, to
within its 50 ms poll), and at the end each rank prints its five longest waits, with the operation, its
number and the step (`before the first step`: start-up, compilation; a barrier after a step: the checkpoint
that rank 0 writes alone; the step after --sample-every: rank 0's sample). BENCHMARKS.md keeps the figures.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmz.run import watchdog
from llmz.train import main

entered: dict[int, tuple[float, str, int | None]] = {}
waits: list[tuple[float, str, int, int | None]] = []
begin, finished = watchdog.Watch.begin, watchdog.Watch.finished


def timed_begin(self, op: str) -> int:
    seq = begin(self, op)
    entered[seq] = (time.monotonic(), op, self.step)
    return seq


def timed_finished(self, seq: int) -> None:
    finished(self, seq)
    t0, op, step = entered.pop(seq)
    waits.append((time.monotonic() - t0, op, seq, step))


def report(rank: int) -> str:
    top = sorted(waits, reverse=True)[:5]
    where = ", ".join(f"{s:.2f} s in {op} #{seq} {'before the first step' if step is None else f'at step {step}'}"
                      for s, op, seq, step in top)
    return f"rank {rank}: {len(waits)} collectives; longest waits: {where}"


if __name__ == "__main__":
    watchdog.Watch.begin, watchdog.Watch.finished = timed_begin, timed_finished
    code = main(sys.argv[1:])
    from llmz.run.launch import _mpi_rank_and_size
    time.sleep(0.2 * watchdog.POLL_S / 0.05)      # the NCCL thread's last poll
    print(report(_mpi_rank_and_size()[0]), file=sys.stderr, flush=True)
    sys.exit(code)
