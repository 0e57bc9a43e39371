"""Collectives between ranks: all-reduce, reduce-scatter, all-gather, broadcast, barrier.

One interface, three backends (`make_communicator` picks one):
  nccl   GPU buffers; NCCL kernels enqueued on dev.comm_stream through CuPy's raw NCCL communicator.
         Asynchronous: the CALLER orders them against compute with events (record an event on the compute
         stream after the kernels that write the buffer, make the comm stream wait on it, and the reverse
         before compute touches the buffer again). Nothing here synchronises the host.
  mpi    mpi4py on host memory. NumPy buffers (cpu, sim) go to MPI directly. CuPy buffers are staged:
         synchronise the whole device, copy to the host, MPI, copy back, synchronise again. That round trip
         through the host, which stalls both streams, is exactly the cost NCCL exists to remove.
Every collective has a deadline, --collective-timeout (llmz.run.watchdog): MPI's are its non-blocking calls
waited on with the deadline; NCCL's are watched by a thread on the host through events, and a CUDA graph's
replay is watched as one operation (`after_graph`).
  local  one rank: every collective is the identity (a sum or an average over one rank), so a single
         process needs no MPI at run time. Calls are still counted.

In place, with NCCL's layout (N ranks, buf flat and contiguous):
  all_reduce(buf, op)      every rank ends with the sum (op="sum") or the average (op="avg") of all bufs
  reduce_scatter(buf, op)  buf holds N slices of n = buf.size / N; rank r's reduced slice lands at
                           buf[r*n:(r+1)*n]; the rest of buf is undefined afterwards
  all_gather(buf)          rank r's input is buf[r*n:(r+1)*n]; afterwards buf holds every rank's slice
  all_gather(buf, src)     the same, rank r's input being src (n elements kept elsewhere: ZeRO-3 gathers a
                           bucket from each rank's parameter shard into a slot; NCCL reads src directly,
                           the other backends first copy it into its place in buf)
  broadcast(buf, root)     every rank ends with root's buf
  start_reduce_scatter(buf, op), start_all_gather(buf, src)
                           the same collectives, started: they return a Request, and request.wait() returns once
                           the collective has completed. ZeRO stages 2 and 3 start them during backward (a
                           finished block's gradients, the next block's parameters) and wait only when they need
                           the result. NCCL's are enqueued on the comm stream (events order them, as above) and
                           local's are the identity: both done at once. MPI's on host buffers stay in flight on
                           the host while backward computes; MPICH moves a non-blocking collective's data only
                           inside MPI calls, so backward calls progress() between layers (one MPI_Test) to move
                           them on. MPI on GPU buffers (staged through the host) completes before it returns.
Every rank ends an all-reduce with the SAME BITS (ZeRO needs identical parameters on all ranks): each
element is reduced once, by the rank that owns it (a reduce-scatter), and then copied (an all-gather).
The average is that sum divided by N (NCCL: its NCCL_AVG, which multiplies by 1/N; exact when N is a power
of two). bf16 buffers (ml_dtypes.bfloat16, or uint16 holding bf16 bits) reduce as bf16.
"""
from __future__ import annotations

import atexit
import contextlib
import time
from collections import Counter, deque
from typing import Any

import numpy as np

from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.errors import AgreedError, LlmzError

COMM_KINDS = ("auto", "nccl", "mpi")
OPS = ("sum", "avg")

# NCCL's enums (nccl.h): ncclDataType_t and ncclRedOp_t
NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 7, 8, 9
NCCL_SUM, NCCL_AVG = 0, 4
NCCL_OPS = {"sum": NCCL_SUM, "avg": NCCL_AVG}


def is_bf16(dtype) -> bool:
    """bf16 arrives as ml_dtypes.bfloat16 or as uint16 holding its bits (Numba cannot type bf16)."""
    dtype = np.dtype(dtype)
    return dtype == np.uint16 or dtype.name == "bfloat16"


def nccl_dtype(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return NCCL_FLOAT32
    if dtype == np.float64:
        return NCCL_FLOAT64
    if is_bf16(dtype):
        return NCCL_BFLOAT16
    raise ValueError(f"no NCCL reduction for dtype {dtype}")


def split_counts(size: int, n: int) -> tuple[list[int], list[int]]:
    """Cut `size` elements into n nearly equal pieces (the first size % n get one more): counts, offsets."""
    counts = [size // n + (1 if i < size % n else 0) for i in range(n)]
    displs = [sum(counts[:i]) for i in range(n)]
    return counts, displs


class Request:
    """A collective started by Communicator.start_reduce_scatter or start_all_gather.

    done          True once it has completed on this rank: at once on local and NCCL (NCCL's is enqueued on the
                  comm stream, which events order), and for MPI on GPU buffers; an MPI collective on host
                  buffers is in flight until progress() finds it complete or wait() waits for it
    completed_at  time.perf_counter() when this rank saw it complete (None: at once), where its span on the
                  timeline ends (llmz.trace)
    wait()        returns once it has completed (MPI: within --collective-timeout, as every collective)
    """

    def __init__(self, comm=None, op: str = "", mpi=None, seq: int = 0, then=None):
        self.comm, self.op, self.mpi, self.seq = comm, op, mpi, seq
        self.then = then                # what completes it on the host once MPI is done (the average, a copy back)
        self.done = mpi is None
        self.completed_at: float | None = None

    def wait(self) -> None:
        if not self.done:
            self.comm.wait_for(self)


class Communicator:
    """The interface, with the accounting; the backends below implement the _underscore methods.

    bytes_sent counts what THIS rank sends under the ring model, S = buf.nbytes (the full buffer), N ranks:
      reduce-scatter  (N-1)/N * S    N-1 steps, each passing one S/N chunk to the next rank (and adding)
      all-gather      (N-1)/N * S    the same N-1 steps, copying instead of adding
      all-reduce     2(N-1)/N * S    a reduce-scatter followed by an all-gather
      broadcast       (N-1)/N * S    a pipelined chain: N-1 ranks forward S each, averaged over the N ranks
    Backends choose other algorithms (trees, recursive halving; MPI reduces bf16 as float32); the model
    is the ZeRO paper's count, so a stage's lesson can check "about 2 bytes per parameter per rank".
    calls counts the calls per operation (a Counter keyed by method name).
    """
    name = "local"

    def __init__(self, ranks, dev=None):
        """ranks: who this rank is among how many (llmz.run.launch.RankInfo), with the watch that bounds every
        collective (ranks.watch: llmz.run.watchdog.Watch); dev: where the buffers live (None: NumPy only)."""
        self.rank = ranks.rank
        self.world_size = ranks.world_size
        self.dev = dev
        self.watch = ranks.watch        # the deadline and the collectives' sequence numbers
        self.bytes_sent = 0
        self.calls: Counter[str] = Counter()

    # ---- the interface --------------------------------------------------------------------------
    def all_reduce(self, buf, op: str = "sum") -> None:
        """In place: every rank ends with the sum / average of every rank's buf, the same bits on all."""
        self._count("all_reduce", _flat_contiguous(buf), 2)
        self._all_reduce(buf, _check_op(op))
        self._after("all_reduce")

    def reduce_scatter(self, buf, op: str = "avg") -> None:
        """In place: rank r's reduced slice at buf[r*n:(r+1)*n], n = buf.size / N; the rest undefined."""
        self.start_reduce_scatter(buf, op).wait()

    def all_gather(self, buf, src=None) -> None:
        """In place: rank r contributes buf[r*n:(r+1)*n], or src (n elements) when given; every rank ends
        with all N slices."""
        self.start_all_gather(buf, src).wait()

    def start_reduce_scatter(self, buf, op: str = "avg") -> Request:
        """reduce_scatter, started: buf is the result once the request's wait() has returned."""
        self._count("reduce_scatter", self._divisible(buf), 1)
        request = self._start_reduce_scatter(buf, _check_op(op))
        self._after("reduce_scatter")
        return request

    def start_all_gather(self, buf, src=None) -> Request:
        """all_gather, started: buf is the result once the request's wait() has returned (src is read at once)."""
        nbytes = self._divisible(buf)
        if src is not None and (src.size * self.world_size != buf.size or src.dtype != buf.dtype):
            raise ValueError(f"all_gather of {buf.size} {buf.dtype} from a slice of {src.size} {src.dtype} "
                             f"on {self.world_size} ranks")
        self._count("all_gather", nbytes, 1)
        request = self._start_all_gather(buf, src)
        self._after("all_gather")
        return request

    def progress(self) -> None:
        """Move on the collectives in flight (MPI: one MPI_Test; nothing elsewhere). Cheap: backward calls it
        between layers."""

    def broadcast(self, buf, root: int = 0) -> None:
        """In place: every rank ends with root's buf."""
        if not 0 <= root < self.world_size:
            raise ValueError(f"broadcast root {root} outside 0..{self.world_size - 1}")
        self._count("broadcast", _flat_contiguous(buf), 1)
        self._broadcast(buf, root)
        self._after("broadcast")

    def barrier(self) -> None:
        self.calls["barrier"] += 1
        self._barrier()

    def group(self):
        """Context manager around several calls that the backend may fuse (NCCL group); a no-op elsewhere."""
        return contextlib.nullcontext()

    def after_graph(self, name: str) -> None:
        """A CUDA graph holding collectives was just launched on the compute stream: NCCL watches its replay
        as one operation (llmz.graph calls this; the collectives inside it are not seen one by one)."""

    def place(self, buf, src) -> None:
        """Copy src into this rank's slice of buf (n = buf.size / N elements), on the comm stream when buf is
        on a GPU: in order with the collective that follows there."""
        n = buf.size // self.world_size
        mine = buf.reshape(-1)[self.rank * n:(self.rank + 1) * n]
        if isinstance(buf, np.ndarray):
            mine[...] = src
        else:
            mine.data.copy_from_device_async(src.data, src.nbytes, self.dev.comm_stream.cupy)

    def reset_counters(self) -> None:
        self.bytes_sent = 0
        self.calls.clear()

    def close(self) -> None:
        pass

    # ---- accounting ---------------------------------------------------------------------------------
    def _count(self, what: str, nbytes: int, rounds: int) -> None:
        n = self.world_size
        self.calls[what] += 1
        self.bytes_sent += rounds * (n - 1) * nbytes // n

    def _divisible(self, buf) -> int:
        nbytes = _flat_contiguous(buf)
        if buf.size % self.world_size:
            raise ValueError(f"buffer of {buf.size} elements does not split into {self.world_size} equal slices")
        return nbytes

    # ---- one rank: the identity ---------------------------------------------------------------------
    def _after(self, op: str) -> None:
        """After collective `op` is issued (NCCL: enqueued): what the backend's watchdog needs."""

    def _all_reduce(self, buf, op: str) -> None:
        pass

    def _reduce_scatter(self, buf, op: str) -> None:
        pass

    def _all_gather(self, buf, src) -> None:
        if src is not None:
            self.place(buf, src)

    def _start_reduce_scatter(self, buf, op: str) -> Request:
        """local and NCCL: the collective itself (NCCL: enqueued on the comm stream), done as far as the host
        is concerned."""
        self._reduce_scatter(buf, op)
        return Request()

    def _start_all_gather(self, buf, src) -> Request:
        self._all_gather(buf, src)
        return Request()

    def _broadcast(self, buf, root: int) -> None:
        pass

    def _barrier(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} of {self.world_size})"


class LocalCommunicator(Communicator):
    """World size 1: sum and average over one rank are the identity; nothing moves."""
    name = "local"


class MpiCommunicator(Communicator):
    """mpi4py on the host: each collective a non-blocking call, waited on within the deadline (llmz.run.watchdog).
    A started collective (start_reduce_scatter, start_all_gather) on host buffers stays in flight until it is
    needed; the ones in flight complete in the order they were started. CuPy buffers go through host copies
    (see the module docstring) and complete before the call returns."""
    name = "mpi"

    def __init__(self, ranks, dev):
        from mpi4py import MPI
        super().__init__(ranks, dev)
        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.in_flight: deque[Request] = deque()        # started, not yet seen complete, oldest first

    # ---- requests: started, progressed, completed in order ------------------------------------------------
    def _start(self, op: str, mpi_request, then=None, buf=None) -> Request:
        """A non-blocking MPI call just posted: numbered for the watchdog, queued behind those in flight. A GPU
        buffer (buf, staged through the host) is waited on at once: its copy back belongs to the streams."""
        request = Request(self, op, mpi_request, self.watch.begin(op), then)
        self.in_flight.append(request)
        if buf is not None and not isinstance(buf, np.ndarray):
            request.wait()
        return request

    def progress(self) -> None:
        """MPICH moves a non-blocking collective only inside an MPI call: one MPI_Test does it for all of them
        (and completes, in order, those that have finished)."""
        while self.in_flight and self.in_flight[0].mpi.Test():
            self._complete(self.in_flight.popleft())

    def wait_for(self, request: Request) -> None:
        """Wait for `request`, and first for every collective started before it, each within the deadline."""
        while not request.done:
            oldest = self.in_flight.popleft()
            self.watch.wait(oldest.op, oldest.mpi, seq=oldest.seq)
            self._complete(oldest)

    def _complete(self, request: Request) -> None:
        request.completed_at = time.perf_counter()
        self.watch.finished(request.seq)
        if request.then is not None:
            request.then()
        request.done = True

    # ---- host buffers ---------------------------------------------------------------------------------------
    def _on_host(self, buf, arith: bool):
        """A flat host array that MPI can work on, and the function that writes it back into buf once the
        collective has completed. arith: the op adds, so bf16 is widened to float32 (MPI has no bf16 sum) and
        rounded back once."""
        on_device = not isinstance(buf, np.ndarray)
        if on_device:
            import cupy
            cupy.cuda.runtime.deviceSynchronize()   # every stream's writes to buf must be finished
            host = cupy.asnumpy(buf)
        else:
            host = buf
        flat = host.reshape(-1)
        bf16 = is_bf16(flat.dtype)
        if bf16:
            flat = flat.view(np.uint16)
        work = bf16_to_f32(flat) if bf16 and arith else flat

        def write_back() -> None:
            if bf16 and arith:
                flat[...] = f32_to_bf16(work)
            if on_device:
                buf.set(host, stream=self.dev.comm_stream.cupy)
                self.dev.comm_stream.synchronize()  # host memory must outlive the copy
        return work, write_back

    def _reduce_scatter_host(self, h: np.ndarray, op: str, what: str, then=None, buf=None) -> Request:
        """Sum (then average) rank r's piece of h into its place in h: computed once, by its owner."""
        MPI, r = self.MPI, self.rank
        counts, displs = split_counts(h.size, self.world_size)

        def finish() -> None:
            mine = h[:counts[r]]                                        # MPI leaves r's piece at h[:counts[r]]
            if op == "avg":
                mine /= self.world_size
            h[displs[r]:displs[r] + counts[r]] = mine                   # move it to its own place
            if then is not None:
                then()
        return self._start(what, self.world.Ireduce_scatter(MPI.IN_PLACE, h, counts, MPI.SUM), finish, buf)

    def _all_gather_host(self, h: np.ndarray, what: str, then=None, buf=None) -> Request:
        counts, displs = split_counts(h.size, self.world_size)
        return self._start(what, self.world.Iallgatherv(self.MPI.IN_PLACE, [h, (counts, displs)]), then, buf)

    # ---- the collectives ------------------------------------------------------------------------------------
    def _all_reduce(self, buf, op: str) -> None:
        h, write_back = self._on_host(buf, arith=True)
        self._reduce_scatter_host(h, op, "all_reduce").wait()
        self._all_gather_host(h, "all_reduce", write_back).wait()

    def _start_reduce_scatter(self, buf, op: str) -> Request:
        h, write_back = self._on_host(buf, arith=True)
        return self._reduce_scatter_host(h, op, "reduce_scatter", write_back, buf)

    def _start_all_gather(self, buf, src) -> Request:
        if src is not None:
            self.place(buf, src)
        h, write_back = self._on_host(buf, arith=False)
        return self._all_gather_host(h, "all_gather", write_back, buf)

    def _broadcast(self, buf, root: int) -> None:
        h, write_back = self._on_host(buf, arith=False)
        self._start("broadcast", self.world.Ibcast(h, root=root), write_back).wait()

    def _barrier(self) -> None:
        self._start("barrier", self.world.Ibarrier()).wait()


class NcclCommunicator(Communicator):
    """NCCL through cupy.cuda.nccl, one GPU per rank, every call enqueued on dev.comm_stream."""
    name = "nccl"

    def __init__(self, ranks, dev):
        import cupy
        from cupy.cuda import nccl
        from mpi4py import MPI
        super().__init__(ranks, dev)
        shared = shared_gpus(ranks, dev)
        if shared:              # every rank found the same (a collective): one line, from rank 0
            raise AgreedError(f"NCCL cannot run {shared}; use --comm mpi", 2)
        self.world = MPI.COMM_WORLD
        self._nccl_module = nccl
        # rank 0 makes the unique id (128 bytes), MPI carries it to the others, all join the communicator
        uid = self.watch.allgather_object(nccl.get_unique_id() if ranks.rank == 0 else None)[0]
        with cupy.cuda.Device(dev.gpu_index):
            self.nccl = nccl.NcclCommunicator(ranks.world_size, uid, ranks.rank)
        self._stream = dev.comm_stream.cupy.ptr
        self._grouped: list[str] | None = None   # inside group(): its collectives, enqueued at its end
        self.watchdog = self.watch.watch_nccl(dev.gpu_index, abort=self._abort)
        atexit.register(self.close)     # before MPI_Finalize (mpi4py registered its handler earlier)

    @staticmethod
    def _ptr(buf) -> int:
        if isinstance(buf, np.ndarray):
            raise TypeError("NCCL works on GPU buffers (CuPy arrays), not NumPy arrays")
        return buf.data.ptr

    def _slice_ptr(self, buf) -> tuple[int, int]:
        """Device pointer of buf and of this rank's slice of it."""
        n = buf.size // self.world_size
        return self._ptr(buf), self._ptr(buf) + self.rank * n * buf.itemsize

    def _all_reduce(self, buf, op: str) -> None:
        p = self._ptr(buf)
        self.nccl.allReduce(p, p, buf.size, nccl_dtype(buf.dtype), NCCL_OPS[op], self._stream)

    def _reduce_scatter(self, buf, op: str) -> None:
        p, mine = self._slice_ptr(buf)          # NCCL in place: recvbuff = sendbuff + rank * recvcount
        self.nccl.reduceScatter(p, mine, buf.size // self.world_size, nccl_dtype(buf.dtype), NCCL_OPS[op],
                                self._stream)

    def _all_gather(self, buf, src) -> None:
        p, mine = self._slice_ptr(buf)          # NCCL in place: sendbuff = recvbuff + rank * sendcount
        if src is not None:
            mine = self._ptr(src)               # out of place: NCCL reads my slice where it is
        self.nccl.allGather(mine, p, buf.size // self.world_size, nccl_dtype(buf.dtype), self._stream)

    def _broadcast(self, buf, root: int) -> None:
        p = self._ptr(buf)
        self.nccl.broadcast(p, p, buf.size, nccl_dtype(buf.dtype), root, self._stream)

    def _barrier(self) -> None:
        self.dev.comm_stream.synchronize()      # every collective enqueued so far has finished here
        if self.world_size > 1:
            self.watch.wait("barrier", self.world.Ibarrier())

    def _after(self, op: str) -> None:
        """An event after the collective on the comm stream, for the watchdog thread; none while the stream
        is being captured into a CUDA graph (the graph's replay is watched instead: after_graph)."""
        if self._grouped is not None:
            self._grouped.append(op)
        elif not self.dev.comm_stream.cupy.is_capturing():
            self.watchdog.after(self.dev.comm_stream.cupy, op)

    def after_graph(self, name: str) -> None:
        self.watchdog.after(self.dev.compute_stream.cupy, f"CUDA graph {name}")

    @contextlib.contextmanager
    def group(self):
        self._nccl_module.groupStart()
        self._grouped = []
        try:
            yield
        finally:
            grouped, self._grouped = self._grouped, None
            self._nccl_module.groupEnd()
            if grouped:
                self._after(f"{grouped[0]} (a group of {len(grouped)})")

    def _abort(self) -> None:
        """The watchdog's deadline passed: ncclCommAbort, which ends this rank's NCCL kernels."""
        if self.nccl is not None:
            self.nccl.abort()

    def close(self) -> None:
        if self.nccl is not None:
            self.watchdog.stop()
            self.dev.comm_stream.synchronize()
            self.nccl.destroy()
            self.nccl = None


def shared_gpus(ranks, dev) -> str:
    """'' when every rank drives its own GPU; else which ranks share one (a collective: all ranks call it)."""
    if ranks.world_size == 1 or dev.kind != "gpu":
        return ""
    import cupy
    bus = cupy.cuda.Device(dev.gpu_index).pci_bus_id
    owners: dict[tuple[str, str], list[int]] = {}
    for r, key in enumerate(ranks.watch.allgather_object((ranks.hostname, bus))):
        owners.setdefault(key, []).append(r)
    for (host, bus), rs in owners.items():
        if len(rs) > 1:
            return f"{len(rs)} ranks on one GPU (ranks {', '.join(map(str, rs))} share {host} {bus})"
    return ""


def make_communicator(kind: str, ranks, dev) -> Communicator:
    """kind 'auto': local for one rank; nccl when every rank has its own GPU; mpi otherwise."""
    if kind not in COMM_KINDS:
        raise LlmzError(f"--comm {kind!r}: choose one of {', '.join(COMM_KINDS)}")
    if kind == "auto":
        if ranks.world_size == 1:
            return LocalCommunicator(ranks, dev)
        kind = "nccl" if dev.kind == "gpu" and not shared_gpus(ranks, dev) else "mpi"
    if kind == "nccl":
        if dev.kind != "gpu":
            raise LlmzError(f"--comm nccl needs --device gpu (device {dev.kind} keeps buffers on the host); "
                            "use --comm mpi")
        return NcclCommunicator(ranks, dev)
    return MpiCommunicator(ranks, dev)


def _check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"reduction {op!r}: choose one of {', '.join(OPS)}")
    return op


def _flat_contiguous(buf: Any) -> int:
    """Collectives see buf as one flat run of memory: it must be C-contiguous. Returns its bytes."""
    if not buf.flags.c_contiguous:
        raise ValueError("collectives need a C-contiguous buffer")
    return buf.nbytes
