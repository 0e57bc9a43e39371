"""Communicators: the one-rank identity and its accounting here; the MPI backend under mpiexec (2 and 4
ranks, through tests/mpi_comm_worker.py); a failing or killed rank ends the whole job quickly; NCCL on GPUs."""
import subprocess
import sys
import time

import numpy as np
import pytest

from llmz.comm import (
    Communicator,
    LocalCommunicator,
    bf16_to_f32,
    f32_to_bf16,
    make_communicator,
    nccl_dtype,
    split_counts,
)
from llmz.device import Device
from llmz.errors import LlmzError
from llmz.run.launch import RankInfo
from mpirun import REPO, run_mpi

WORKER = "tests/mpi_comm_worker.py"
ONE = RankInfo(rank=0, world_size=1, local_rank=0, local_size=1, hostname="here")


def _python(code: str) -> subprocess.CompletedProcess:
    """A plain process, no mpiexec: what a user gets from `python -m llmz.train`."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                          check=False)


# ---- one rank, in this process -----------------------------------------------------------------------
def test_local_communicator_is_identity_and_counts_calls(rng):
    comm = make_communicator("auto", ONE, Device("cpu", np.float64))
    assert isinstance(comm, LocalCommunicator)
    x = rng.standard_normal(11)
    buf = x.copy()
    comm.all_reduce(buf, "sum")
    comm.all_reduce(buf, "avg")
    comm.reduce_scatter(buf, "avg")
    comm.all_gather(buf)
    comm.broadcast(buf, 0)
    comm.barrier()
    with comm.group():
        comm.all_reduce(buf)
    assert np.array_equal(buf, x)                   # sum and average over one rank: the identity, bit for bit
    assert dict(comm.calls) == {"all_reduce": 3, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1,
                                "barrier": 1}
    assert comm.bytes_sent == 0                     # (N-1)/N of anything is nothing when N = 1


def test_bytes_sent_follows_the_ring_model():
    comm = Communicator(RankInfo(1, 4, 1, 4, "here"))       # the base class: accounting, no transport
    f32 = np.zeros(1000, np.float32)                        # 4000 bytes
    comm.all_reduce(f32)
    assert comm.bytes_sent == 2 * 3 * 4000 // 4
    comm.reset_counters()
    comm.reduce_scatter(f32)
    comm.all_gather(f32)
    assert comm.bytes_sent == 2 * 3 * 4000 // 4             # reduce-scatter + all-gather = one all-reduce
    comm.reset_counters()
    comm.broadcast(np.zeros(1000, np.uint16), root=3)
    assert comm.bytes_sent == 3 * 2000 // 4


def test_collectives_reject_buffers_they_cannot_split():
    comm = Communicator(RankInfo(0, 4, 0, 4, "here"))
    with pytest.raises(ValueError, match="4 equal slices"):
        comm.reduce_scatter(np.zeros(10))
    with pytest.raises(ValueError, match="4 equal slices"):
        comm.all_gather(np.zeros(10))
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(np.zeros((4, 4))[:, 0])
    with pytest.raises(ValueError, match="choose one of sum, avg"):
        comm.all_reduce(np.zeros(4), "max")
    with pytest.raises(ValueError, match="root 4"):
        comm.broadcast(np.zeros(4), 4)


def test_make_communicator_refuses_unknown_kinds_and_nccl_without_gpu():
    cpu = Device("cpu", np.float32)
    with pytest.raises(LlmzError, match="choose one of auto, nccl, mpi"):
        make_communicator("gloo", ONE, cpu)
    with pytest.raises(LlmzError, match="--comm nccl needs --device gpu"):
        make_communicator("nccl", ONE, cpu)


def test_split_counts_cover_the_buffer_in_nearly_equal_pieces():
    assert split_counts(7, 4) == ([2, 2, 2, 1], [0, 2, 4, 6])
    assert split_counts(1, 4) == ([1, 0, 0, 0], [0, 1, 1, 1])
    assert split_counts(8, 4) == ([2, 2, 2, 2], [0, 2, 4, 6])


def test_nccl_dtypes_match_nccl_h():
    assert nccl_dtype(np.float32) == 7 and nccl_dtype(np.float64) == 8
    assert nccl_dtype(np.uint16) == 9               # bf16 bits in a uint16 array
    with pytest.raises(ValueError):
        nccl_dtype(np.int32)


def test_bf16_rounding_is_to_nearest_even(rng):
    ulp = 2.0**-7                                   # bf16 spacing in [1, 2)
    x = np.array([1.0, 1 + ulp / 2, 1 + 1.5 * ulp, 1 + 0.5001 * ulp, -3.0, np.inf, -np.inf, 3.4e38],
                 np.float32)
    want = np.array([1.0, 1.0, 1 + 2 * ulp, 1 + ulp, -3.0, np.inf, -np.inf, np.inf], np.float32)
    assert np.array_equal(bf16_to_f32(f32_to_bf16(x)), want)      # ties go to the even neighbour
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]
    y = rng.standard_normal(10000).astype(np.float32)
    # the nearest of 8 significant bits: within half a spacing, 2^-8 relative
    assert np.all(np.abs(bf16_to_f32(f32_to_bf16(y)) - y) <= 2.0**-8 * np.abs(y))


def test_one_process_without_mpiexec_is_rank_0_of_1_and_launch_imports_no_mpi():
    out = _python("import sys, llmz.run.launch, llmz.comm\n"
                  "assert 'mpi4py.MPI' not in sys.modules, 'importing llmz.run.launch started MPI'\n"
                  "print(llmz.run.launch.init_ranks())")
    assert out.returncode == 0, out.stderr
    assert "RankInfo(rank=0, world_size=1, local_rank=0, local_size=1" in out.stdout


def test_abort_on_error_in_one_process_prints_one_line_and_exits_1():
    out = _python("from llmz.run.launch import abort_on_error\nfrom llmz.errors import LlmzError\n"
                  "with abort_on_error():\n    raise LlmzError('data/x.bin: not a token file')")
    assert out.returncode == 1
    assert out.stderr == "error: data/x.bin: not a token file\n"


# ---- several ranks, under mpiexec --------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("nproc", [2, 4])
def test_mpi_collectives_match_numpy_and_agree_bitwise_on_every_rank(nproc):
    out = run_mpi(nproc, [WORKER, "collectives"], timeout=60, env={"LLMZ_DEBUG": "1"})
    assert out.returncode == 0, out.stderr
    for r in range(nproc):
        assert f"rank {r} of {nproc}: collectives ok (mpi)" in out.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("nproc,error,line", [
    (2, "llmz", "rank 1: error: planted failure in the input"),
    (4, "value", "rank 3: error: ValueError: planted failure in the code"),
])
def test_exception_on_one_rank_ends_every_rank_fast_with_one_error_line(nproc, error, line):
    t0 = time.time()
    out = run_mpi(nproc, [WORKER, "raise", "--error", error], timeout=60)
    took = time.time() - t0
    print(f"{nproc} ranks, one raised: job ended in {took:.1f} s")
    assert out.returncode != 0
    assert took < 20
    assert out.stderr.count("planted failure") == 1, out.stderr
    assert line in out.stderr.splitlines()
    assert "Traceback" not in out.stderr
    assert "still alive" not in out.stdout


@pytest.mark.mpi
def test_killed_rank_ends_the_job():
    t0 = time.time()
    out = run_mpi(4, [WORKER, "kill"], timeout=60)
    took = time.time() - t0
    print(f"4 ranks, one SIGKILLed: job ended in {took:.1f} s")
    assert out.returncode != 0                      # Hydra reports the dead rank and kills the others
    assert took < 30
    assert "still alive" not in out.stdout


# ---- GPUs (skipped without one) ---------------------------------------------------------------------
def _gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.mpi
def test_nccl_collectives_match_numpy_on_every_gpu():
    n = _gpu_count()                                # one rank per GPU (NCCL with one rank works too)
    out = run_mpi(n, [WORKER, "collectives", "--device", "gpu", "--comm", "nccl"], timeout=120,
                  env={"LLMZ_DEBUG": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("collectives ok (nccl)") == n


@pytest.mark.gpu
@pytest.mark.mpi
def test_mpi_backend_stages_gpu_buffers_through_the_host():
    out = run_mpi(2, [WORKER, "collectives", "--device", "gpu", "--comm", "mpi"], timeout=120,
                  env={"LLMZ_DEBUG": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("collectives ok (mpi)") == 2


@pytest.mark.gpu
@pytest.mark.mpi
def test_nccl_refuses_two_ranks_on_one_gpu_and_auto_falls_back_to_mpi():
    n = _gpu_count() + 1
    out = run_mpi(n, [WORKER, "collectives", "--device", "gpu", "--comm", "nccl"], timeout=120)
    assert out.returncode == 2                      # found alike by every rank: one line, from rank 0
    assert out.stderr.count("NCCL cannot run") == 1 and out.stderr.startswith("error: NCCL cannot run 2 ranks on "
                                                                             "one GPU"), out.stderr
    assert "use --comm mpi" in out.stderr
    out = run_mpi(n, [WORKER, "collectives", "--device", "gpu", "--comm", "auto"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("collectives ok (mpi)") == n
