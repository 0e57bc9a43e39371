"""The program each rank runs for tests/test_comm.py (started by mpirun.run_mpi, never by pytest itself).

    mpiexec -n N python tests/mpi_comm_worker.py collectives [--device cpu|gpu] [--comm auto|mpi|nccl]
        every collective against NumPy on every rank; prints `rank R of N: collectives ok (<backend>)`
    mpiexec -n N python tests/mpi_comm_worker.py raise [--error llmz|value]
        the last rank raises while the others wait in collectives: abort_on_error must end them all
    mpiexec -n N python tests/mpi_comm_worker.py kill
        the last rank kills itself (SIGKILL) during a loop of collectives: the launcher must end the rest
    mpiexec -n N python tests/mpi_comm_worker.py freeze --timeout S
        the last rank stops itself (SIGSTOP) during a loop of collectives, after printing `freezing at T`
        (time.time()): the others' watchdog must end the job, naming it, within S + 10 s
    mpiexec -n N python tests/mpi_comm_worker.py freeze --started --timeout S
        the same with a reduce-scatter started (start_reduce_scatter) each step: the last rank stops with it in
        flight, the others wait for it
    mpiexec -n N python tests/mpi_comm_worker.py vanish
        the last rank exits (status 0, no MPI_Finalize) during a loop of collectives: the others must name it
    python tests/mpi_comm_worker.py hang --device gpu --comm nccl --timeout S
        one rank: a kernel that spins until the communicator is aborted holds the comm stream, and an
        all-reduce is queued behind it; the NCCL watchdog thread must print one line, abort the communicator
        and end the process (status 124) within S + 10 s
Every rank can rebuild every rank's input (seeded by rank), so each checks the full answer itself.
"""
import argparse
import hashlib
import os
import signal
import sys
import time

import numpy as np

from llmz.comm import bf16_to_f32, f32_to_bf16, make_communicator
from llmz.device import Device
from llmz.errors import LlmzError
from llmz.run import watchdog
from llmz.run.launch import abort_on_error, init_ranks


def rank_inputs(size: int, n: int) -> list[np.ndarray]:
    return [np.random.default_rng([size, r, 593]).standard_normal(size) for r in range(n)]


class Checker:
    def __init__(self, comm, dev):
        from mpi4py import MPI
        self.comm, self.dev, self.world = comm, dev, MPI.COMM_WORLD
        self.r, self.n = comm.rank, comm.world_size

    def on_device(self, x: np.ndarray):
        buf = self.dev.asarray(x)
        self.settle()
        return buf

    def settle(self) -> None:
        """Tests read and write buffers from the host: let every stream finish (NCCL is asynchronous)."""
        self.dev.synchronize()
        if self.dev.kind == "gpu":
            import cupy
            cupy.cuda.runtime.deviceSynchronize()

    def host(self, buf) -> np.ndarray:
        self.settle()
        return self.dev.to_host(buf)

    def same_bits_on_all_ranks(self, a: np.ndarray, what: str) -> None:
        digests = self.world.allgather(hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
        assert len(set(digests)) == 1, f"{what}: ranks differ in their bits"

    def all_reduce(self, dtype, size: int) -> None:
        xs = [x.astype(dtype) for x in rank_inputs(size, self.n)]
        total = np.sum(np.stack(xs).astype(np.float64), axis=0)
        # N terms added in another order than NumPy's: a few ulps of the sum of magnitudes
        tol = (1e-13 if dtype == np.float64 else 1e-6) * np.sum(np.abs(np.stack(xs)), axis=0)
        for op, expected in (("sum", total), ("avg", total / self.n)):
            buf = self.on_device(xs[self.r])
            self.comm.all_reduce(buf, op)
            got = self.host(buf)
            assert got.dtype == dtype
            err = np.abs(got - expected) - tol / (1 if op == "sum" else self.n)
            assert np.all(err <= 0), f"all_reduce {op} {np.dtype(dtype)} size {size}: off by {err.max()}"
            self.same_bits_on_all_ranks(got, f"all_reduce {op} {np.dtype(dtype)} size {size}")

    def reduce_scatter(self, dtype, n: int) -> None:
        xs = [x.astype(dtype) for x in rank_inputs(self.n * n, self.n)]
        expected = np.sum(np.stack(xs).astype(np.float64), axis=0) / self.n
        tol = (1e-13 if dtype == np.float64 else 1e-6) * np.sum(np.abs(np.stack(xs)), axis=0) / self.n
        buf = self.on_device(xs[self.r])
        self.comm.reduce_scatter(buf, "avg")
        mine = slice(self.r * n, (self.r + 1) * n)
        got = self.host(buf)[mine]
        assert np.all(np.abs(got - expected[mine]) <= tol[mine]), f"reduce_scatter {np.dtype(dtype)}: wrong slice"

    def all_gather(self, dtype, n: int) -> None:
        full = np.concatenate([x[:n] for x in rank_inputs(n, self.n)]).astype(dtype)
        start = np.full_like(full, np.nan)
        start[self.r * n:(self.r + 1) * n] = full[self.r * n:(self.r + 1) * n]    # only my slice is known
        buf = self.on_device(start)
        self.comm.all_gather(buf)
        assert np.array_equal(self.host(buf), full), f"all_gather {np.dtype(dtype)}: not every slice arrived"
        # from my slice kept in another buffer (ZeRO-3's shard): nothing of mine is in buf beforehand
        buf, src = self.on_device(np.full_like(full, np.nan)), self.on_device(full[self.r * n:(self.r + 1) * n])
        self.comm.all_gather(buf, src=src)
        assert np.array_equal(self.host(buf), full), f"all_gather {np.dtype(dtype)} from src: not every slice arrived"

    def started(self, dtype, n: int) -> None:
        """start_reduce_scatter / start_all_gather: three in flight at once, progressed, the newest waited for
        (which waits for the older ones too): every request done, the same bits as the blocking calls."""
        xs = [x.astype(np.float32) for x in rank_inputs(self.n * n, self.n)]
        xs = [f32_to_bf16(x) for x in xs] if dtype == np.uint16 else [x.astype(dtype) for x in xs]
        blocking = self.on_device(xs[self.r])
        self.comm.reduce_scatter(blocking, "avg")
        full = np.concatenate([xs[r][r * n:(r + 1) * n] for r in range(self.n)])    # rank r's slice r, in order
        bufs = [self.on_device(xs[self.r]) for _ in range(2)]
        gathered = self.on_device(np.zeros_like(full))
        requests = [self.comm.start_reduce_scatter(bufs[0], "avg"),
                    self.comm.start_all_gather(gathered, src=self.on_device(full[self.r * n:(self.r + 1) * n])),
                    self.comm.start_reduce_scatter(bufs[1], "avg")]
        self.comm.progress()
        requests[-1].wait()
        assert all(r.done for r in requests), "waiting for the newest left an older collective in flight"
        mine = slice(self.r * n, (self.r + 1) * n)
        for buf in bufs:
            assert np.array_equal(self.host(buf)[mine], self.host(blocking)[mine]), \
                f"started reduce_scatter {np.dtype(dtype)}: not the blocking call's bits"
        assert np.array_equal(self.host(gathered), full), f"started all_gather {np.dtype(dtype)}: wrong"
        if self.comm.name == "mpi":         # every collective numbered and finished, in order, on the board
            watch = self.comm.watch
            assert watch.board[watchdog.DONE] == watch.board[watchdog.POSTED] == watch.seq, list(watch.board)

    def broadcast(self, dtype, size: int) -> None:
        xs = [x.astype(dtype) for x in rank_inputs(size, self.n)]
        for root in sorted({0, self.n - 1}):
            buf = self.on_device(xs[self.r])
            self.comm.broadcast(buf, root)
            assert np.array_equal(self.host(buf), xs[root]), f"broadcast from {root}: not root's buffer"

    def bf16(self, size: int) -> None:
        """bf16 as uint16 bits: the sum is the float sum rounded to bf16 (once in MPI, per step in NCCL)."""
        bits = [f32_to_bf16(x.astype(np.float32)) for x in rank_inputs(size, self.n)]
        values = np.stack([bf16_to_f32(b) for b in bits]).astype(np.float64)
        buf = self.on_device(bits[self.r])
        self.comm.all_reduce(buf, "sum")
        got = self.host(buf)
        assert got.dtype == np.uint16
        # bf16 keeps 8 significant bits: each rounding is at most 2^-8 relative to what is being summed
        tol = self.n * 2.0**-8 * np.sum(np.abs(values), axis=0)
        assert np.all(np.abs(bf16_to_f32(got) - values.sum(axis=0)) <= tol), "bf16 all_reduce wrong"
        self.same_bits_on_all_ranks(got, "bf16 all_reduce")
        full = np.concatenate(bits)
        start = np.zeros_like(full)
        start[self.r * size:(self.r + 1) * size] = bits[self.r]
        buf = self.on_device(start)
        self.comm.all_gather(buf)
        assert np.array_equal(self.host(buf), full), "bf16 all_gather wrong"

    def counters(self) -> None:
        c, n = self.comm, self.n
        c.reset_counters()
        self.comm.all_reduce(self.on_device(np.ones(1000)), "sum")            # 8000 bytes
        self.comm.reduce_scatter(self.on_device(np.ones(n * 5)), "avg")     # 40 n bytes
        self.comm.reduce_scatter(self.on_device(np.ones(n * 5)), "sum")
        self.comm.all_gather(self.on_device(np.ones(n * 5)))
        self.comm.broadcast(self.on_device(np.ones(1000)), 0)
        self.comm.barrier()
        self.settle()
        assert dict(c.calls) == {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 1, "broadcast": 1,
                                 "barrier": 1}, dict(c.calls)
        expected = 2 * (n - 1) * 8000 // n + 3 * ((n - 1) * 40 * n // n) + (n - 1) * 8000 // n
        assert c.bytes_sent == expected, (c.bytes_sent, expected)


def collectives(ranks, args) -> None:
    gpu_index = ranks.gpu_index
    if args.device == "gpu":                # more ranks than GPUs: share them, so NCCL's refusal can be tested
        import cupy
        gpu_index %= cupy.cuda.runtime.getDeviceCount()
    dev = Device(args.device, np.float64, gpu_index=gpu_index)
    comm = make_communicator(args.comm, ranks, dev)
    if args.comm == "auto" and args.device == "cpu":
        assert comm.name == ("mpi" if ranks.world_size > 1 else "local"), f"auto on cpu with {ranks.world_size} ranks chose {comm.name}"
    check = Checker(comm, dev)
    for dtype in (np.float64, np.float32):
        for size in (1, 7, 1001):       # fewer elements than ranks; not divisible by 2 or 4
            check.all_reduce(dtype, size)
        check.reduce_scatter(dtype, 5)
        check.all_gather(dtype, 3)
        check.broadcast(dtype, 7)
    for dtype in (np.float64, np.float32, np.uint16):
        check.started(dtype, 5000)          # 40 kB a rank in float64: past MPICH's eager limit
    check.bf16(9)
    check.counters()
    comm.close()
    print(f"rank {ranks.rank} of {ranks.world_size}: collectives ok ({comm.name})", flush=True)


def failing(ranks, args) -> None:
    dev = Device("cpu", np.float64)
    comm = make_communicator("auto", ranks, dev)
    buf = np.ones(16)
    comm.all_reduce(buf)
    if ranks.rank == ranks.world_size - 1:
        time.sleep(0.2)
        if args.error == "llmz":
            raise LlmzError("planted failure in the input")
        raise ValueError("planted failure in the code")
    t0 = time.time()
    while time.time() - t0 < 60:        # the others wait in collectives for a rank that never comes
        comm.all_reduce(buf)
    print(f"rank {ranks.rank}: still alive after 60 s", flush=True)


def killed(ranks, args) -> None:
    dev = Device("cpu", np.float64)
    comm = make_communicator("auto", ranks, dev)
    buf = np.ones(4096)
    t0 = time.time()
    while time.time() - t0 < 60:
        comm.all_reduce(buf, "avg")
        if ranks.rank == ranks.world_size - 1 and time.time() - t0 > 0.5:
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"rank {ranks.rank}: still alive after 60 s", flush=True)


def frozen(ranks, args) -> None:
    """--started: each step starts a reduce-scatter, works, then waits for it (ZeRO-2 on CPU ranks); the last
    rank stops with it in flight."""
    comm = make_communicator("auto", ranks, Device("cpu", np.float64))
    buf = np.ones(4096 if not args.started else 1 << 20)
    for step in range(10**9):
        comm.watch.step = step
        request = comm.start_reduce_scatter(buf, "avg") if args.started else comm.all_reduce(buf, "avg")
        if ranks.rank == ranks.world_size - 1 and step == 20:
            print(f"rank {ranks.rank}: freezing at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.started:
            comm.progress()
            request.wait()


def vanishing(ranks, args) -> None:
    comm = make_communicator("auto", ranks, Device("cpu", np.float64))
    buf = np.ones(16)
    for step in range(10**9):
        comm.watch.step = step
        comm.all_reduce(buf)
        if ranks.rank == ranks.world_size - 1 and step == 20:
            os._exit(0)


def hung(ranks, args) -> None:
    """A collective that cannot run: the comm stream is held by a kernel that spins until a flag is set. It
    stands for an NCCL kernel waiting for a peer that never comes (one process on one GPU cannot make NCCL
    itself wait: NCCL refuses two ranks on one GPU), and like NCCL's kernels it gives up when the communicator
    is aborted: the abort hook sets its flag (from a stream of its own, which does not wait for the comm
    stream), then calls ncclCommAbort."""
    import cupy
    from numba import cuda

    @cuda.jit
    def spin(flag):
        while cuda.atomic.add(flag, 0, 0) == 0:
            pass
    dev = Device(args.device, np.float32, gpu_index=ranks.gpu_index)
    comm = make_communicator(args.comm, ranks, dev)
    buf = dev.asarray(np.ones(1024, np.float32))
    comm.all_reduce(buf)                        # one that completes
    dev.synchronize()
    flag = dev.zeros(1, np.int32)
    release = cupy.cuda.Stream(non_blocking=True)
    abort = comm.watchdog.abort
    comm.watchdog.abort = lambda: (flag.set(np.ones(1, np.int32), stream=release), abort())
    dev.launch(spin, 1, 1, flag, stream=dev.comm_stream)
    comm.watch.step = 7
    comm.all_reduce(buf)                        # queued behind the spin: never starts
    print(f"rank {ranks.rank}: waiting at {time.time():.3f}", flush=True)
    dev.synchronize()                           # blocks here until the watchdog acts
    time.sleep(60)                              # the watchdog ends the process meanwhile
    print(f"rank {ranks.rank}: still alive", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("collectives", "raise", "kill", "freeze", "vanish", "hang"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--comm", default="auto")
    p.add_argument("--error", default="llmz", choices=("llmz", "value"))
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--started", action="store_true", help="freeze: with a started collective in flight")
    args = p.parse_args()
    ranks = init_ranks(collective_timeout=args.timeout)
    with abort_on_error(ranks):
        {"collectives": collectives, "raise": failing, "kill": killed, "freeze": frozen, "vanish": vanishing,
         "hang": hung}[args.mode](ranks, args)


if __name__ == "__main__":
    sys.exit(main())
