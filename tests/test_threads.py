"""One BLAS thread pool per rank (llmz/run/threads.py): N ranks on a host share its cores but one,
max(1, (cores - 1) // N) threads each (one rank too), a size set in the environment is kept, and train's start
line says what each rank got."""
import pytest
from threadpoolctl import threadpool_limits

from llmz.run import threads
from mpirun import cpu_cores, run_mpi


@pytest.mark.parametrize("cores, ranks, each", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1), (3, 1, 2), (16, 1, 15),
                                               (16, 4, 3), (16, 3, 5)])
def test_each_rank_gets_its_share_of_the_cores_and_at_least_one(monkeypatch, cores, ranks, each):
    monkeypatch.setattr(threads, "cores", lambda: cores)
    assert threads.per_rank(ranks) == each


def test_share_cores_sizes_the_loaded_blas_pool_and_note_says_so(monkeypatch):
    import numpy
    for var in threads.USER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 5)
    with threadpool_limits(limits=None):                    # whatever happens inside is undone after
        threads.share_cores(2)
        assert set(threads.pool_sizes().values()) == {2}
        assert threads.note(2).startswith("2 BLAS threads per rank (") and \
            "5 cores, one left free, 2 ranks on this host; OMP_NUM_THREADS=N to choose)" in threads.note(2)


def test_a_pool_size_set_in_the_environment_is_kept_and_named(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with threadpool_limits(limits=None):
        before = threads.pool_sizes()
        threads.share_cores(8)
        assert threads.pool_sizes() == before
        assert threads.note(8).endswith("; OMP_NUM_THREADS=3)")


@pytest.mark.mpi
def test_two_ranks_on_one_host_each_start_with_their_share_of_the_cores():
    p = run_mpi(2, ["-m", "llmz.train", "--device", "cpu", "--model", "tiny", "-b", "2", "-t", "8", "--steps", "1",
                    "--val-every", "0", "--sample-tokens", "0", "--quiet"], env={"OMP_NUM_THREADS": ""})
    assert p.returncode == 0, p.stderr
    each = max(1, (cpu_cores() - 1) // 2)
    first = p.stdout.splitlines()[0]
    assert f"; {each} BLAS thread{'s' if each > 1 else ''} per rank (" in first, first
    assert f"{cpu_cores()} cores, one left free, 2 ranks on this host;" in first, first


def test_one_rank_leaves_a_core_free_and_says_so():
    import subprocess
    import sys

    from mpirun import REPO
    env = {k: v for k, v in __import__("os").environ.items() if k not in threads.USER_VARS}
    p = subprocess.run([sys.executable, "-m", "llmz.train", "--device", "cpu", "--model", "tiny", "-b", "2", "-t", "8",
                        "--steps", "1", "--val-every", "0", "--sample-tokens", "0", "--quiet", "--no-run-dir"],
                       cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    each = max(1, cpu_cores() - 1)
    first = p.stdout.splitlines()[0]
    assert f"; {each} BLAS thread{'s' if each > 1 else ''} per rank (" in first, first
    assert f"{cpu_cores()} core" in first and "1 rank on this host; OMP_NUM_THREADS=N to choose)" in first, first
