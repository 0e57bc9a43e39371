"""Does MPI move a non-blocking collective while the rank computes, and how many MPI calls does it need?

    mpiexec -n 2 python tools/mpi_progress.py

What ZeRO-2/3 on CPU ranks rely on (llmz/comm.py's start_reduce_scatter, progress()): for buffers of 4 KB to
17 MB (summed over 2 ranks), rank 0 prints the median of 7 tries of
  blocking    MPI_Reduce_scatter, both ranks entering together (after a barrier)
  waited      MPI_Ireduce_scatter started on both ranks, 20 ms of NumPy work without an MPI call, then its
              Wait: as long as `blocking` when nothing moved during the work
  tests       MPI_Ireduce_scatter started, then one MPI_Test after each millisecond of work until it completes:
              how many Tests it took, and the time spent inside them
BENCHMARKS.md ("Overlap on CPU ranks") keeps the figures.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def work(ms: float) -> None:
    """ms of NumPy work (small products, no MPI call)."""
    t0, a = time.perf_counter(), np.random.default_rng(0).random((64, 64))
    while time.perf_counter() - t0 < ms / 1e3:
        a = a @ a
        a /= np.abs(a).max()


def ms(seconds: list[float]) -> str:
    return f"{np.median(seconds) * 1e3:.3f} ms"


def started(h: np.ndarray):
    counts = [h.size // WORLD.size] * WORLD.size
    return WORLD.Ireduce_scatter(MPI.IN_PLACE, h, counts, MPI.SUM)


def main() -> None:
    if WORLD.rank == 0:
        print(f"{WORLD.size} ranks, {MPI.Get_library_version().splitlines()[0]}")
    for n in (1 << 8, 1 << 13, 1 << 17, 1 << 20):
        h = np.ones(n * WORLD.size)
        blocking, waited, tests, in_tests = [], [], [], []
        for _ in range(7):
            WORLD.Barrier()
            t0 = time.perf_counter()
            WORLD.Reduce_scatter(MPI.IN_PLACE, h, [n] * WORLD.size, MPI.SUM)
            blocking.append(time.perf_counter() - t0)
            WORLD.Barrier()
            request = started(h)
            work(20)
            t0 = time.perf_counter()
            request.Wait()
            waited.append(time.perf_counter() - t0)
            WORLD.Barrier()
            request, k, inside = started(h), 0, 0.0
            while True:
                work(1)
                k += 1
                t0 = time.perf_counter()
                done = request.Test()
                inside += time.perf_counter() - t0
                if done:
                    break
            tests.append(k)
            in_tests.append(inside)
        if WORLD.rank == 0:
            print(f"{h.nbytes / 1e6:8.3f} MB: blocking {ms(blocking)} | waited after 20 ms of work {ms(waited)} | "
                  f"Tests needed {sorted(tests)}, {ms(in_tests)} inside them")


if __name__ == "__main__":
    main()
