"""The product through cuBLAS (llm.c's llmc/matmul.cuh role): c[z] (+)= alpha * op(a[z]) @ op(b[z]), the
arguments of llmz/kernels/gemm.py's gemm, whose tiled kernel (TILE x TILE shared-memory tiles, CUDA cores)
this replaces when dev.matmul == 'cublas' (--matmul; a GPU only): cuBLAS's gemmEx / gemmStridedBatchedEx,
called through ctypes, on tensor cores. fp32 inputs on TF32 tensor cores (fp32
accumulation; --no-tf32: full fp32), bf16 inputs (uint16 bit patterns) on bf16 tensor cores with fp32
accumulation, c rounded to bf16 once; accumulate=True is beta=1: cuBLAS adds into c, no extra buffer.
gemm_heads: B*NH products whose matrices sit at per-head addresses inside one array (gemmBatchedEx), so
attention reads q, k, v straight out of the (B,T,3C) activation (llmz.fast.attention).
Contract: full fp32 within 1e-6 relative (normwise) of the float64 product, as the tiled kernel; TF32 ~1e-3
(10-bit mantissas in the products); bf16 one bf16 rounding of an fp32-accumulated product.

cuBLAS is column-major and our arrays are row-major. A row-major (r, s) matrix read column-major is its
transpose, so c = op(a) @ op(b) is computed as c.T = op(b).T @ op(a).T: the same call with a and b swapped
and every leading dimension the number of columns of the row-major array.
"""
import numpy as np

from ..kernels.gemm import gemm_tiled

# ---- cuBLAS --------------------------------------------------------------------------
# cudaDataType and cublasComputeType_t values (cuda/library_types.h, cublas_api.h)
CUDA_R_32F, CUDA_R_64F, CUDA_R_16BF = 0, 1, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20      # cuBLAS's workspace, set once: nothing is allocated while a graph is captured


def _types(dev, dtype):
    """(data type, compute type) for cuBLAS: fp32 on TF32 tensor cores unless dev.tf32 is off; bf16 (stored
    as uint16 bit patterns) on bf16 tensor cores with fp32 accumulation."""
    if dtype == np.uint16:
        return CUDA_R_16BF, CUBLAS_COMPUTE_32F
    if dtype == np.float32:
        return CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32 if dev.tf32 else CUBLAS_COMPUTE_32F
    if dtype == np.float64:
        return CUDA_R_64F, CUBLAS_COMPUTE_64F
    raise TypeError(f"cuBLAS gemm: no path for {dtype}")


class _Cublas:
    """Our own cuBLAS handle, called through ctypes: CuPy's wrappers refuse every cuBLAS call while a stream
    is being captured into a CUDA graph, cuBLAS itself does not. The handle gets its own workspace (so
    nothing is allocated during a capture); alpha and beta live in host memory that stays put (cuBLAS
    reads them when the call is enqueued, also while a graph is captured)."""

    NAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")

    def __init__(self, dev):
        import ctypes

        # CuPy's cuBLAS module links the libcublas CuPy was built against: once it is loaded, dlopen finds
        # that same library by its name
        from cupy_backends.cuda.libs import cublas  # noqa: F401
        for name in self.NAMES:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError(f"cuBLAS: none of {', '.join(self.NAMES)} could be loaded")
        P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib = self.lib
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(P)]
        lib.cublasSetStream_v2.argtypes = [P, P]
        lib.cublasSetWorkspace_v2.argtypes = [P, P, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [P, I, I, I, I, I, P, P, I, I, P, I, I, P, P, I, I, I, I]
        lib.cublasGemmStridedBatchedEx.argtypes = [P, I, I, I, I, I, P, P, I, I, L, P, I, I, L, P, P, I, I, L,
                                                   I, I, I]
        lib.cublasGemmBatchedEx.argtypes = [P, I, I, I, I, I, P, P, I, I, P, I, I, P, P, I, I, I, I, I]
        handle = P()
        self.check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.workspace = dev.zeros(WORKSPACE_BYTES, np.uint8)
        self.check(lib.cublasSetWorkspace_v2(handle, self.workspace.data.ptr, WORKSPACE_BYTES),
                   "cublasSetWorkspace")
        self.check(lib.cublasSetStream_v2(handle, dev.compute_stream.cupy.ptr), "cublasSetStream")
        self.scalars = {}                # (value, numpy dtype) -> a 1-element host array kept alive
        self.pointers = {}               # Heads.key -> the device array of its matrices' addresses

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed: cublasStatus_t {status}")

    def call_args(self, dev, dtype, trans_a: bool, trans_b: bool, accumulate: bool, alpha: float) -> tuple:
        """What every gemm call takes besides shapes and pointers: (data type, compute type, &alpha, &beta,
        op(a), op(b)); alpha and beta are fp32 scalars for an fp32 compute type, fp64 for fp64."""
        data, compute = _types(dev, dtype)
        sdt = np.float64 if compute == CUBLAS_COMPUTE_64F else np.float32
        return (data, compute, self.scalar(alpha, sdt), self.scalar(1.0 if accumulate else 0.0, sdt),
                CUBLAS_OP_T if trans_a else CUBLAS_OP_N, CUBLAS_OP_T if trans_b else CUBLAS_OP_N)

    def scalar(self, value: float, dtype) -> int:
        key = (float(value), np.dtype(dtype).str)
        a = self.scalars.get(key)
        if a is None:
            a = self.scalars[key] = np.array([value], dtype=dtype)
        return a.ctypes.data


def _cublas(dev) -> _Cublas:
    if dev._cublas is None:
        dev._cublas = _Cublas(dev)
    return dev._cublas


def gemm_cublas(dev, c, a, b, trans_a: bool, trans_b: bool, accumulate: bool, alpha: float = 1.0) -> None:
    """c (+)= alpha * op(a) @ op(b) with cuBLAS, on the compute stream."""
    cb = _cublas(dev)
    batched = c.ndim == 3
    Z = c.shape[0] if batched else 1
    M, N = c.shape[-2:]
    K = a.shape[-2] if trans_a else a.shape[-1]
    dtype, compute, al, be, opa, opb = cb.call_args(dev, c.dtype, trans_a, trans_b, accumulate, alpha)
    lda, ldb = a.shape[-1], b.shape[-1]
    name = f"cublas {'batch ' + str(Z) + ' x ' if batched else ''}{M}x{N}x{K} {'NT'[trans_a]}{'NT'[trans_b]}"
    with dev.region(name, flops=2 * Z * M * N * K, nbytes=a.nbytes + b.nbytes + c.nbytes):
        if not batched:
            # c.T (N,M) = op(b).T (N,K) @ op(a).T (K,M), column-major
            cb.check(cb.lib.cublasGemmEx(cb.handle, opb, opa, N, M, K, al, b.data.ptr, dtype, ldb,
                                         a.data.ptr, dtype, lda, be, c.data.ptr, dtype, N, compute,
                                         CUBLAS_GEMM_DEFAULT), "cublasGemmEx")
        else:
            cb.check(cb.lib.cublasGemmStridedBatchedEx(
                cb.handle, opb, opa, N, M, K, al, b.data.ptr, dtype, ldb, b[0].size, a.data.ptr, dtype, lda,
                a[0].size, be, c.data.ptr, dtype, N, c[0].size, Z, compute, CUBLAS_GEMM_DEFAULT),
                "cublasGemmStridedBatchedEx")


class Heads:
    """B*NH matrices of rows x cols inside one array, matrix z = b*NH + h starting at element
    offset + b*stride_b + h*stride_h, consecutive rows `ld` elements apart. Attention reads q, k, v of head h
    straight out of the (B,T,3C) qkv activation this way (offset 0, C or 2C; stride_b T*3C; stride_h hs;
    ld 3C) and writes its output into (B,T,C): no head-major copies."""

    def __init__(self, array, offset: int, stride_b: int, stride_h: int, ld: int, rows: int, cols: int,
                 B: int, NH: int):
        self.array, self.offset, self.stride_b, self.stride_h = array, offset, stride_b, stride_h
        self.ld, self.rows, self.cols, self.B, self.NH = ld, rows, cols, B, NH
        self.key = (array.data.ptr, offset, stride_b, stride_h, B, NH, array.dtype.itemsize)

    def part(self, row0: int, rows: int, col0: int, cols: int) -> "Heads":
        """The rows x cols block of every matrix starting at (row0, col0)."""
        return Heads(self.array, self.offset + row0 * self.ld + col0, self.stride_b, self.stride_h, self.ld,
                     rows, cols, self.B, self.NH)

    def pointers(self, dev, cb: "_Cublas") -> int:
        """The device array of the B*NH matrices' addresses (made on the first call: the warm-up step)."""
        ptrs = cb.pointers.get(self.key)
        if ptrs is None:
            b, h = np.meshgrid(np.arange(self.B), np.arange(self.NH), indexing="ij")
            elems = self.offset + b * self.stride_b + h * self.stride_h
            host = (self.array.data.ptr + elems.reshape(-1) * self.array.dtype.itemsize).astype(np.uint64)
            ptrs = cb.pointers[self.key] = dev.asarray(host)
        return ptrs.data.ptr


def gemm_heads(dev, c: Heads, a: Heads, b: Heads, trans_a: bool, trans_b: bool, accumulate: bool,
               alpha: float = 1.0) -> None:
    """For every head z: c[z] (+)= alpha * op(a[z]) @ op(b[z]), cuBLAS's gemmBatchedEx over address arrays."""
    cb = _cublas(dev)
    Z, M, N = a.B * a.NH, c.rows, c.cols
    K = a.rows if trans_a else a.cols
    dtype, compute, al, be, opa, opb = cb.call_args(dev, c.array.dtype, trans_a, trans_b, accumulate, alpha)
    isz = c.array.dtype.itemsize
    name = f"cublas heads {Z} x {M}x{N}x{K} {'NT'[trans_a]}{'NT'[trans_b]}"
    with dev.region(name, flops=2 * Z * M * N * K, nbytes=Z * isz * (M * K + K * N + M * N)):
        # c[z].T = op(b[z]).T @ op(a[z]).T, column-major, as in gemm_cublas
        cb.check(cb.lib.cublasGemmBatchedEx(
            cb.handle, opb, opa, N, M, K, al, b.pointers(dev, cb), dtype, b.ld, a.pointers(dev, cb), dtype, a.ld,
            be, c.pointers(dev, cb), dtype, c.ld, Z, compute, CUBLAS_GEMM_DEFAULT), "cublasGemmBatchedEx")


def gemm(dev, c, a, b, trans_a: bool, trans_b: bool, accumulate: bool, alpha: float = 1.0) -> None:
    """c (+)= alpha * op(a) @ op(b): cuBLAS when dev.matmul == 'cublas', else the teaching tiled kernel."""
    if dev.matmul == "cublas":
        gemm_cublas(dev, c, a, b, trans_a, trans_b, accumulate, alpha)
    else:
        gemm_tiled(dev, c, a, b, trans_a, trans_b, accumulate, alpha)
