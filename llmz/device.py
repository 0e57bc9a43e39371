"""The three ways to execute the same model, and which op set runs there.

  gpu  CuPy owns the memory; every layer is a Numba @cuda.jit kernel launched on a CuPy stream
       (numba.cuda.external_stream), so CuPy (cuBLAS, NCCL) and Numba share one ordered stream.
  cpu  the NumPy reference of every layer, in float32 or float64.
  sim  the same Numba kernels as `gpu`, run by Numba's CUDA simulator on NumPy arrays
       (NUMBA_ENABLE_CUDASIM=1, which must be set before numba is first imported).

Three op sets offer the same layer functions under the same names and arguments, the Device first:
`llmz.reference` (the NumPy references, written beside their kernels in llmz/kernels/), `llmz.kernels` (the
teaching set: the simplest correct kernel per layer) and `llmz.fast` (the kernels that won, each tested
against its teaching twin). `op_set` below is the one place that picks one: cpu runs the references, gpu and
sim the set --kernels names (fast on a GPU by default, teaching elsewhere; the fast set also runs in the
simulator, its warp shuffles emulated there, with the tiled product in place of cuBLAS). The model and the
ZeRO stages call `dev.ops.layernorm_forward(dev, ...)` and never ask which device they run on. --matmul and
--attention refine the kernel sets: the products by cuBLAS (fast, GPU) or the tiled teaching kernel;
attention as flash attention (never storing the T x T scores; on a GPU in bf16 the fast set's tensor-core
kernels, the default there), cuBLAS batched products around a softmax kernel (fast, GPU: the fp32 default)
or the direct teaching kernels. The precision (llmz.precision) is resolved once too: `dev.precision` says
the dtype of every kind of array. Streams and events exist on all three devices; on cpu and sim they are
no-ops because everything already runs in program order.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback

import numpy as np

from .precision import Precision, as_precision

KINDS = ("auto", "gpu", "cpu", "sim")
KERNEL_SETS = ("auto", "teaching", "fast")
MATMULS = ("auto", "cublas", "numba")
ATTENTIONS = ("auto", "gemm", "direct", "flash")

# Ordering between streams is ours to make, with events (llmz.zero). Left on, CuPy would export its current
# stream with every array and Numba would synchronise that stream on the host at every kernel launch that
# takes a CuPy array: a host sync per kernel, and impossible inside a captured CUDA graph.
os.environ.setdefault("CUPY_CUDA_ARRAY_INTERFACE_EXPORT_VERSION", "2")
os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (never imports numba)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (no CuPy, no driver, no device: all mean 'no GPU')
        return False


def resolve(kind: str) -> str:
    """Turn 'auto' into 'gpu' or 'cpu'; prepare the simulator for 'sim'. Call before importing numba."""
    if kind not in KINDS:
        raise ValueError(f"unknown device {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = "gpu" if gpu_available() else "cpu"
    if kind == "sim":
        if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
            raise RuntimeError("--device sim must be chosen before numba is imported")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if kind == "gpu" and not gpu_available():
        raise RuntimeError("--device gpu: no CUDA GPU visible to CuPy (install llmz[gpu], or use --device cpu)")
    return kind


def kernel_paths(kind: str, kernel_set: str = "auto", matmul: str = "auto",
                 attention: str = "auto", precision: str = "fp32") -> tuple[str, str, str]:
    """(kernel set, matmul, attention) for a resolved device kind, the flags and the precision ('fp32', 'fp64'
    or 'bf16'): 'auto' filled in, and a ValueError of one line for a combination that cannot run."""
    if kernel_set not in KERNEL_SETS or matmul not in MATMULS or attention not in ATTENTIONS:
        raise ValueError(f"unknown --kernels {kernel_set!r}, --matmul {matmul!r} or --attention {attention!r}")
    if kernel_set == "auto":
        kernel_set = "fast" if kind == "gpu" else "teaching"
    if kernel_set == "fast" and kind == "cpu":
        raise ValueError("--kernels fast runs on --device gpu or sim (on cpu every layer is its NumPy reference)")
    if matmul == "cublas" and kind != "gpu":
        raise ValueError(f"--matmul cublas needs a GPU (the device here is {kind}); use --matmul numba")
    if matmul == "cublas" and kernel_set != "fast":
        raise ValueError("--matmul cublas is part of the fast kernels: add --kernels fast (or use --matmul numba)")
    if matmul == "auto":
        matmul = "cublas" if kernel_set == "fast" and kind == "gpu" else "numba"
    if attention == "gemm" and matmul != "cublas":
        raise ValueError("--attention gemm reads each head in place with cuBLAS: it needs --kernels fast and "
                         "--matmul cublas on a GPU (use --attention direct)")
    if attention == "auto":
        # on a GPU: bf16 attention on tensor cores (llmz.fast.flash_attention, the faster path: see
        # BENCHMARKS.md's flash attention tables); fp32 keeps cuBLAS's TF32 products around the softmax
        # kernels
        if matmul == "cublas":
            attention = "flash" if precision == "bf16" else "gemm"
        else:
            attention = "direct"
    return kernel_set, matmul, attention


class _NoStream:
    """cpu / sim: work runs in program order, so a stream is just a name."""
    def __init__(self, name: str):
        self.name = name
        self.numba = 0          # the simulator accepts stream 0

    def synchronize(self) -> None:
        pass


class _NoEvent:
    def record(self, stream) -> None:
        pass

    def wait(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _GpuStream:
    """A CuPy stream plus the Numba handle for the same CUDA stream (made once: wrapping costs time)."""
    def __init__(self, name: str):
        import cupy
        from numba import cuda
        self.name = name
        # a blocking stream: it waits for work on the legacy default stream and that stream waits for it,
        # so a stray CuPy call that lands on the default stream stays in order (a non-blocking stream
        # raced there: parameters uploaded on one stream were read on another before they arrived)
        self.cupy = cupy.cuda.Stream(non_blocking=False)
        self.numba = cuda.external_stream(self.cupy.ptr)

    def synchronize(self) -> None:
        self.cupy.synchronize()


class _GpuEvent:
    """record(stream) marks a point in `stream`; wait(other) makes `other` wait for it on the device."""
    def __init__(self, timing: bool = False):
        import cupy
        self.cupy = cupy.cuda.Event(disable_timing=not timing)

    def record(self, stream) -> None:
        self.cupy.record(stream.cupy)

    def wait(self, stream) -> None:
        stream.cupy.wait_event(self.cupy)

    def synchronize(self) -> None:
        self.cupy.synchronize()


def _thread_safe_simulator_shared() -> None:
    """Numba's simulator gives a block's threads one shared array per source line, made by the first thread
    to get there: `get`, and if absent `np.empty` and store, unlocked. Two threads of a block passing the line
    at once each made their own, and a reduction through it then missed the other lanes (seen: a column sum
    wrong in its first column, 1 run in ~10, more often with a short thread switch interval). Here the same
    lookup, keyed as the simulator keys it (the calling file and line), runs under a lock; dynamic shared
    memory (shape 0) goes to the simulator as before."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    if getattr(FakeCUDAShared.array, "thread_safe", False):
        return
    simulators, lock = FakeCUDAShared.array, threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return simulators(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[-1][0:2])
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res
    array.thread_safe = True
    FakeCUDAShared.array = array


def _simulator_warp_shuffles() -> None:
    """Numba's simulator has no warp shuffles; the fast kernels' warp reductions need cuda.shfl_xor_sync.
    Here it is a post and two block barriers: every thread puts its value in its block's table, the block
    meets, each thread reads lane ^ offset's value, the block meets again. Right when every live thread of
    the block shuffles the same number of times, as the fast kernels' warps do (they shuffle in lockstep and
    a warp leaves a kernel as a whole)."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    def shfl_xor_sync(self, mask, value, offset):
        me = threading.current_thread()
        table = me._manager.__dict__.setdefault("llmz_shuffle", {})     # one per block (its manager)
        table[me.thread_id] = value
        me.syncthreads()
        other = table[me.thread_id ^ offset]
        me.syncthreads()
        return other
    FakeCUDAModule.shfl_xor_sync = shfl_xor_sync


def op_set(kind: str, kernel_set: str):
    """The layer functions a Device runs: the one place that chooses them. cpu: llmz.reference, the NumPy
    references; gpu and sim: llmz.kernels (teaching) or llmz.fast, as kernel_paths resolved --kernels.
    Imported here, when a Device is made: the kernels import numba, which must come after resolve()."""
    if kind == "cpu":
        from . import reference as ops
    elif kernel_set == "fast":
        from . import fast as ops
    else:
        from . import kernels as ops
    return ops


class Device:
    """Where arrays live, how kernels launch, and which op set runs (`ops`). `precision` (a Precision, its
    name, or the storage dtype: np.float32, np.float64, np.uint16 for bf16) gives `dtype`, the dtype of
    parameters, gradients and activations."""

    def __init__(self, kind: str = "cpu", precision: Precision | str | np.dtype = np.float32,
                 gpu_index: int = 0, matmul: str = "auto", attention: str = "auto", tf32: bool = True,
                 kernel_set: str = "auto"):
        self.kind = resolve(kind)
        self.precision = as_precision(precision)
        self.dtype = self.precision.storage
        # which kernels run (--kernels: llmz.kernels, the teaching set, or llmz.fast), how products are
        # computed (cuBLAS or the tiled kernel) and attention (gemm, direct or flash): kernel_paths
        self.kernel_set, self.matmul, self.attention = kernel_paths(self.kind, kernel_set, matmul, attention,
                                                                    self.precision.name)
        self.fast = self.kernel_set == "fast"
        self.ops = op_set(self.kind, self.kernel_set)
        self.tf32 = tf32                                 # cuBLAS fp32 products on TF32 tensor cores
        self._cublas = None
        self.profile = None                              # a list while per-kernel timing is on (llmz.bench)
        self.profile_pace = None                         # called before each timed region (llmz.bench's pacer)
        # threads per block for 1-D kernels: the simulator runs each thread as a Python thread, keep it small
        self.block_size = 32 if self.kind == "sim" else 256
        if self.kind == "sim":
            _thread_safe_simulator_shared()
            _simulator_warp_shuffles()
        if self.kind == "gpu":
            import cupy
            # ranks beyond the GPU count share GPUs (then only --comm mpi works: NCCL refuses)
            gpu_index %= cupy.cuda.runtime.getDeviceCount()
            cupy.cuda.Device(gpu_index).use()
            self.xp = cupy
            self.compute_stream = _GpuStream("compute")
            self.comm_stream = _GpuStream("comm")
            # every CuPy operation (allocation, memset, copy, cuBLAS) now runs on the compute stream, in
            # order with the Numba kernels: no race with work on the legacy default stream
            self.compute_stream.cupy.use()
            from numba import cuda
            self._as_numba = cuda.as_cuda_array
        else:
            self.xp = np
            self.compute_stream = _NoStream("compute")
            self.comm_stream = _NoStream("comm")
        self.gpu_index = gpu_index
        self._scratch: dict = {}

    # ---- memory -------------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        """On the GPU the fill runs on this Device's compute stream, even when a later Device (a second Run
        in the same process, as in the lessons) has made its own stream CuPy's current one."""
        if self.kind != "gpu":
            return np.zeros(shape, dtype=dtype or self.dtype)
        with self.compute_stream.cupy:
            return self.xp.zeros(shape, dtype=dtype or self.dtype)

    def empty(self, shape, dtype=None):
        return self.xp.empty(shape, dtype=dtype or self.dtype)

    def full(self, shape, value, dtype=None):
        """A new array filled with `value` (on the GPU, filled on this Device's compute stream)."""
        if self.kind != "gpu":
            return np.full(shape, value, dtype=dtype or self.dtype)
        with self.compute_stream.cupy:
            return self.xp.full(shape, value, dtype=dtype or self.dtype)

    def scratch(self, name: str, shape, dtype=None):
        """A kernel's scratch buffer (partial sums, bucket tables), allocated on the first request for this
        name and shape and reused after: the warm-up step allocates, a captured step never does. Only the
        compute stream may use it (one kernel's scratch is free again once the next kernel starts)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        key = (name, shape, np.dtype(dtype or self.dtype).str)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = self.zeros(shape, dtype)
        return buf

    def asarray(self, a, dtype=None):
        """Host (NumPy) array -> an array on this device (a copy; on the GPU ordered on the compute stream)."""
        a = np.ascontiguousarray(a, dtype=dtype)
        if self.kind != "gpu":
            return a.copy()
        with self.compute_stream.cupy:
            return self.xp.asarray(a)

    def memset_zero(self, x, stream=None) -> None:
        """x = 0, every byte (all-zero bits are +0.0 in float32, float64 and bf16); x C-contiguous. On the GPU one
        cudaMemsetAsync on the compute stream (or `stream`), capturable into a CUDA graph like a kernel;
        elsewhere a plain store (everything there runs in program order)."""
        if self.kind != "gpu":
            x[...] = 0
            return
        with self.region("memset", nbytes=x.nbytes, stream=stream):
            x.data.memset_async(0, x.nbytes, (stream or self.compute_stream).cupy)

    def copy_from_host(self, dst, src: np.ndarray) -> None:
        """dst (on this device) <- src (NumPy), ordered on the compute stream."""
        if self.kind == "gpu":
            dst.set(np.ascontiguousarray(src, dtype=dst.dtype), stream=self.compute_stream.cupy)
        else:
            dst[...] = src

    def copy(self, dst, src) -> None:
        """Device-to-device copy on the compute stream."""
        if self.kind == "gpu":
            with self.compute_stream.cupy:
                self.xp.copyto(dst, src)
        else:
            dst[...] = src

    def to_host(self, a) -> np.ndarray:
        if self.kind == "gpu":
            return a.get(stream=self.compute_stream.cupy) if hasattr(a, "get") else np.asarray(a)
        return np.asarray(a)

    # ---- execution ----------------------------------------------------------------------------
    def launch(self, kernel, grid, block, *args, stream=None, shared: int = 0, flops: int = 0) -> None:
        """kernel[grid, block, stream, shared](*args) on the compute stream (or `stream`)."""
        s = (stream or self.compute_stream).numba
        if self.kind == "gpu":
            # CuPy arrays as Numba device arrays (through __cuda_array_interface__): handed over directly,
            # Numba would take them through DLPack, which records an event on the legacy stream at every
            # launch (slow, and refused while a CUDA graph is being captured)
            args = tuple(self._as_numba(a, sync=False) if isinstance(a, self.xp.ndarray) else a for a in args)
        if self.profile is None:
            kernel[grid, block, s, shared](*args)
            return
        nbytes = sum(a.nbytes for a in args if hasattr(a, "nbytes") and hasattr(a, "shape"))
        with self.region(kernel.py_func.__name__, flops=flops, nbytes=nbytes, stream=stream):
            kernel[grid, block, s, shared](*args)

    def launch_per_element(self, kernel, arrays, *extra, stream=None) -> None:
        """kernel(*arrays flattened, n, *extra) with one thread per element of the same-size arrays (n of them):
        the launch of the teaching set's elementwise kernels."""
        from .kernels.grid import ceil_div  # numba is loaded by now (the kernel is a numba kernel)
        n = arrays[0].size
        self.launch(kernel, ceil_div(n, self.block_size), self.block_size, *(a.reshape(-1) for a in arrays), n,
                    *extra, stream=stream)

    @contextlib.contextmanager
    def region(self, name: str, flops: int = 0, nbytes: int = 0, stream=None):
        """While self.profile is a list, time the GPU work enqueued inside with two CUDA events and append
        (name, start, end, flops, bytes) to it; otherwise do nothing. nbytes: the arrays the work touches,
        each counted once (reads + writes of a kernel that streams through them)."""
        if self.profile is None or self.kind != "gpu":
            yield
            return
        if self.profile_pace is not None:
            self.profile_pace()
        s = stream or self.compute_stream
        e0, e1 = self.event(timing=True), self.event(timing=True)
        e0.record(s)
        yield
        e1.record(s)
        self.profile.append((name, e0, e1, flops, nbytes))

    def event(self, timing: bool = False):
        return _GpuEvent(timing) if self.kind == "gpu" else _NoEvent()

    def synchronize(self) -> None:
        self.compute_stream.synchronize()
        self.comm_stream.synchronize()

    def describe(self) -> str:
        """What runs the layers, for a run's first line: 'fast kernels (matmul cublas, attention flash)'."""
        if self.kind == "cpu":
            return "the NumPy references"
        return f"{self.kernel_set} kernels (matmul {self.matmul}, attention {self.attention})"

    def __repr__(self) -> str:
        return f"Device({self.kind}, {self.precision.name}, {self.describe()})"
