"""One BLAS thread pool per rank, sized to the cores the ranks of a host share, one core left to the rest of
the machine.

NumPy's BLAS (OpenBLAS in NumPy's wheels) starts a thread per core in every process, and a product waits for
its slowest thread, each spinning while it waits. With N ranks on one host every rank's pool takes every
core: N x cores busy-waiting threads on `cores` cores (2 ranks of the default run on 2 cores: 275 ms a step,
against 112 ms with one thread a rank: README). One other busy process does the same to a pool that takes
every core: on the 2-core machine with one core kept busy, the default run took 3-7x as long with 2 threads
as with 1, while 2 threads gained little on the quiet machine (BENCHMARKS.md, "BLAS threads per rank"). So each rank
gets max(1, (cores - 1) // ranks on this host) threads: a pool that leaves a core to whatever else runs.
threadpoolctl sets the size of the pools of the BLAS and OpenMP libraries already loaded (llmz.train imports
NumPy before it knows the ranks, too late for OMP_NUM_THREADS); a size the user chose in the environment
(OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS) is kept.

llmz.run.launch.init_ranks calls share_cores once the ranks are known; note() is the start line's words for it.
"""
from __future__ import annotations

import os

USER_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a launcher's binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                  # no affinity on this OS (macOS)
        return os.cpu_count() or 1


def user_choice() -> str | None:
    """'OMP_NUM_THREADS=4' when the environment sets a pool size, else None."""
    return next((f"{v}={os.environ[v]}" for v in USER_VARS if os.environ.get(v, "").strip()), None)


def per_rank(ranks_on_host: int) -> int:
    """Threads for each of `ranks_on_host` ranks: the host's cores but one shared out, at least one."""
    return max(1, (cores() - 1) // max(1, ranks_on_host))


def share_cores(ranks_on_host: int) -> None:
    """Size this rank's BLAS and OpenMP pools to per_rank(ranks_on_host), unless the environment chose."""
    if user_choice():
        return
    from threadpoolctl import threadpool_limits
    threadpool_limits(limits=per_rank(ranks_on_host))      # called, not entered: the limit stays


def blas_threads() -> int:
    """The threads of the BLAS pool NumPy's products run on (the largest, should several be loaded)."""
    from threadpoolctl import threadpool_info
    return max((p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"), default=1)


def pool_sizes() -> dict[str, int]:
    """{library: threads} of the thread pools loaded in this process (openblas, openmp, mkl, ...)."""
    from threadpoolctl import threadpool_info
    return {p["internal_api"]: p["num_threads"] for p in threadpool_info()}


def note(ranks_on_host: int) -> str:
    """The start line's words: '1 BLAS thread per rank (openblas; 2 cores, one left free, 2 ranks on this host;
    OMP_NUM_THREADS=N to choose)', or the variable that chose it."""
    pools = pool_sizes()
    n = max(pools.values(), default=1)
    libs = ", ".join(pools) or "no BLAS pool loaded"
    c = cores()
    why = user_choice() or (f"{c} core{'s, one left free' if c > 1 else ''}, {ranks_on_host} "
                            f"rank{'s' if ranks_on_host != 1 else ''} on this host; OMP_NUM_THREADS=N to choose")
    return f"{n} BLAS thread{'s' if n != 1 else ''} per rank ({libs}; {why})"
