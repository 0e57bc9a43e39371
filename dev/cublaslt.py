"""Products with cuBLASLt epilogues (llm.c's matmul_cublaslt, llmc/matmul.cuh), through ctypes on our own
handle: a candidate beside nvmath-python in dev/matmul.py, not yet run on a GPU (it moves to llmz/fast/ if it
measures faster than both today's kernels and nvmath-python). In the style of llmz.fast.gemm (whose cuBLAS
handle it sits beside: the same stream, a workspace of its own set once, scalars in host memory that stays
put, so every call can be captured into a CUDA graph).

    matmul_lt(dev, c, a, b, trans_a, trans_b, accumulate, epilogue, bias=None, aux=None, alpha=1.0)

computes c (+)= alpha * op(a) @ op(b) (row-major, as llmz.fast.gemm.gemm) and then the epilogue, in the
product's own kernel (no extra pass over c):

  "default"        nothing more
  "bias"           c = product + bias (bias (N,), one per column of c): the linear layer's forward without
                   the bias fill kernel (llmz.fast.matmul)
  "gelu_aux_bias"  aux = product + bias, c = gelu(aux) (tanh form): the MLP's fc + GELU, aux the pre-GELU
                   activation backward needs (c, aux (M, N))
  "dgelu"          c = product * gelu'(aux): the fcproj backward's dinp straight into the GELU's input gradient
  "dgelu_bgrad"    as dgelu, and bias = the column sums of c (the fc bias gradient), overwritten
  "bgradb"         bias (M,) = the row sums of op(a) (its sums over the product's k): the weight-gradient
                   product dW = dout.T @ inp (op(a) = dout.T) with the bias gradient dbias = the column sums
                   of dout, overwritten (cuBLASLt's gradient epilogues write, they do not add)
Row-major c = op(a) @ op(b) is cuBLASLt's column-major c.T = op(b).T @ op(a).T: cuBLASLt's "A" is our b and
its "B" our a, m = N, n = M; so its bias (length m) is one per column of our c, and BGRADB (the reduction of
its B over k) sums our a over the product's k axis.
bf16 values (uint16 bits) on bf16 tensor cores with fp32 accumulation; fp32 values on TF32 tensor cores
(dev.tf32) or full fp32. Descriptors, layouts and the chosen algorithm are made once per call shape and kept.
Contract: the bias and GELU epilogues are cuBLASLt's (the product rounded once after the epilogue; its GELU is
the tanh form, within bf16 rounding of llmz.kernels.gelu's); checked against the float64 reference in
dev/matmul.py and tests/test_dev_kernels.py (GPU).
"""
import ctypes

import numpy as np

from llmz.fast.gemm import CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_16BF, CUDA_R_32F

# cublasLtEpilogue_t (cublasLt.h)
EPILOGUES = {"default": 1, "bias": 4, "gelu_aux_bias": 32 | 128 | 4, "dgelu": 64 | 128,
             "dgelu_bgrad": 64 | 128 | 16, "bgradb": 512}
# cublasLtMatmulDescAttributes_t
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_AUX_POINTER, DESC_AUX_LD, DESC_BIAS_DATA_TYPE = 11, 12, 26
PREF_MAX_WORKSPACE_BYTES = 1
HEURISTIC_RESULT_BYTES = 96         # cublasLtMatmulHeuristicResult_t: algo (64), workspace size, state, waves, 4 ints
WORKSPACE_BYTES = 32 << 20
NAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")
P, I32, U64, I64, SZ = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t


def _load_library():
    # CuPy's cuBLAS module links the libcublas (and so the libcublasLt) CuPy was built against
    from cupy_backends.cuda.libs import cublas  # noqa: F401
    for name in NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"cuBLASLt: none of {', '.join(NAMES)} could be loaded")


class _Plan:
    """One call shape's descriptors and algorithm (kept for the run: a captured graph replays them)."""

    def __init__(self, lt, key, bias, aux):
        data, compute, M, N, K, trans_a, trans_b, epilogue, lda, ldb, ldc = key
        self.desc = lt.create("cublasLtMatmulDescCreate", I32(compute), I32(CUDA_R_32F))
        # cuBLASLt's A is our b, its B our a (see the module docstring)
        lt.set_desc(self.desc, DESC_TRANSA, I32(int(trans_b)))
        lt.set_desc(self.desc, DESC_TRANSB, I32(int(trans_a)))
        lt.set_desc(self.desc, DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epilogue]))
        if epilogue != "default":
            lt.set_desc(self.desc, DESC_BIAS_DATA_TYPE, I32(data))
        # the heuristic reads the pointers' alignment: set them before it (matmul_lt sets each call's)
        set_pointers(lt, self.desc, bias, aux, N)
        # column-major shapes: A (N x K, or K x N when transposed), B (K x M, or M x K), C = D (N x M)
        self.a = lt.layout(data, *((K, N) if trans_b else (N, K)), ldb)
        self.b = lt.layout(data, *((M, K) if trans_a else (K, M)), lda)
        self.c = lt.layout(data, N, M, ldc)
        pref = lt.create("cublasLtMatmulPreferenceCreate")
        size = U64(WORKSPACE_BYTES)
        lt.check(lt.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                             ctypes.sizeof(size)), "PreferenceSetAttribute")
        self.heuristic = ctypes.create_string_buffer(HEURISTIC_RESULT_BYTES)
        found = I32(0)
        lt.check(lt.lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, self.desc, self.a, self.b, self.c, self.c, pref, 1,
                                                       ctypes.addressof(self.heuristic), ctypes.byref(found)),
                 "AlgoGetHeuristic")
        self.algo = ctypes.addressof(self.heuristic)    # the result's first field is the algorithm
        lt.lib.cublasLtMatmulPreferenceDestroy(pref)
        if found.value < 1:
            raise RuntimeError(f"cuBLASLt: no algorithm for {key}")


class _CublasLt:
    """Our cuBLASLt handle (ctypes), its workspace and the plans made so far."""

    def __init__(self, dev):
        self.lib = lib = _load_library()
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(P)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(P), I32, I32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [P, I32, P, SZ]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(P), I32, U64, U64, I64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(P)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [P, I32, P, SZ]
        lib.cublasLtMatmulPreferenceDestroy.argtypes = [P]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [P, P, P, P, P, P, P, I32, P, ctypes.POINTER(I32)]
        lib.cublasLtMatmul.argtypes = [P, P, P, P, P, P, P, P, P, P, P, P, P, P, SZ, P]
        self.handle = self.create("cublasLtCreate")
        self.workspace = dev.zeros(WORKSPACE_BYTES, np.uint8)
        self.stream = dev.compute_stream.cupy.ptr
        self.plans: dict = {}
        self.scalars = {v: np.array([v], np.float32) for v in (0.0, 1.0)}

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cublasLt{what} failed: cublasStatus_t {status}")

    def create(self, fn: str, *args):
        out = P()
        self.check(getattr(self.lib, fn)(ctypes.byref(out), *args), fn[len("cublasLt"):])
        return out

    def set_desc(self, desc, attr: int, value) -> None:
        self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "MatmulDescSetAttribute")

    def layout(self, data: int, rows: int, cols: int, ld: int):
        return self.create("cublasLtMatrixLayoutCreate", I32(data), U64(rows), U64(cols), I64(ld))

    def scalar(self, value: float) -> int:
        a = self.scalars.get(value)
        if a is None:
            a = self.scalars[value] = np.array([value], np.float32)
        return a.ctypes.data


def set_pointers(lt, desc, bias, aux, ld: int) -> None:
    """The epilogue's bias (or bias gradient) and aux pointers on a descriptor (aux rows ld elements apart)."""
    if bias is not None:
        lt.set_desc(desc, DESC_BIAS_POINTER, P(bias.data.ptr))
    if aux is not None:
        lt.set_desc(desc, DESC_AUX_POINTER, P(aux.data.ptr))
        lt.set_desc(desc, DESC_AUX_LD, I64(ld))


def _lt(dev) -> _CublasLt:
    lt = getattr(dev, "_cublaslt", None)
    if lt is None:
        lt = dev._cublaslt = _CublasLt(dev)
    return lt


def _types(dev, dtype) -> tuple[int, int]:
    if dtype == np.uint16:
        return CUDA_R_16BF, CUBLAS_COMPUTE_32F
    if dtype == np.float32:
        return CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32 if dev.tf32 else CUBLAS_COMPUTE_32F
    raise TypeError(f"cuBLASLt matmul: no path for {dtype}")


def matmul_lt(dev, c, a, b, trans_a: bool, trans_b: bool, accumulate: bool, epilogue: str = "default",
              bias=None, aux=None, alpha: float = 1.0) -> None:
    """c (M,N) (+)= alpha * op(a) @ op(b), then the epilogue (module docstring), on the compute stream. bias:
    (N,) for "bias" and "gelu_aux_bias" (read), the bias gradient (N,) for "dgelu_bgrad" and (M,) for
    "bgradb" (written); aux: (M, N) like c (written by "gelu_aux_bias", read by the dgelu ones)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown cuBLASLt epilogue {epilogue!r}; choose from {', '.join(EPILOGUES)}")
    lt = _lt(dev)
    M, N = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    data, compute = _types(dev, c.dtype)
    key = (data, compute, M, N, K, trans_a, trans_b, epilogue, a.shape[1], b.shape[1], N)
    plan = lt.plans.get(key)
    if plan is None:
        plan = lt.plans[key] = _Plan(lt, key, bias, aux)
    # the pointers change from call to call (layers, buckets): set on the kept descriptor each time
    set_pointers(lt, plan.desc, bias, aux, N)
    name = f"cublasLt {M}x{N}x{K} {'NT'[trans_a]}{'NT'[trans_b]} {epilogue}"
    nbytes = a.nbytes + b.nbytes + c.nbytes * (2 if accumulate else 1) + (aux.nbytes if aux is not None else 0)
    with dev.region(name, flops=2 * M * N * K, nbytes=nbytes):
        lt.check(lt.lib.cublasLtMatmul(lt.handle, plan.desc, lt.scalar(alpha), b.data.ptr, plan.a, a.data.ptr,
                                       plan.b, lt.scalar(1.0 if accumulate else 0.0), c.data.ptr, plan.c,
                                       c.data.ptr, plan.c, plan.algo, lt.workspace.data.ptr, WORKSPACE_BYTES,
                                       lt.stream), "Matmul")
