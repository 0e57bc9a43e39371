"""The one product every linear layer (and the fast set's attention) is made of:

    c[z] (+)= alpha * op(a[z]) @ op(b[z])       for each batch index z;  op(x) = x, or x.T when trans_x

a, b, c are C-contiguous, 2-D (one product) or 3-D (a batch of products of the same shape); the product
overwrites c, or accumulates onto it (accumulate=True: the value c held is read and added, as cuBLAS's
beta=1). The kernel, gemm_tiled_kernel: TILE x TILE tiles of a and b staged through shared memory, one thread
per element of c, the products summed in float64 (the CUDA programming guide's shared-memory matmul).
a, b, c may each be float32, float64 or uint16 (bf16 bits), through llmz.kernels.bf16's load / store; a bf16
operand is staged as float32 (exact), and c is rounded once.
"""
import numpy as np
from numba import cuda, types
from numba.cuda.extending import overload

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store
from .grid import ceil_div

TILE = 16   # the tiled kernel's blocks are TILE x TILE threads; each block computes one TILE x TILE tile of c


# ---- NumPy reference ----------------------------------------------------------------------------
def gemm_ref(c, a, b, trans_a: bool, trans_b: bool, accumulate: bool, alpha: float = 1.0) -> None:
    """c (Z,M,N) or (M,N) (+)= alpha * op(a) @ op(b). uint16 (bf16 bits) arrays: computed in float32, c
    rounded to nearest once."""
    if is_bf16(c) or is_bf16(a) or is_bf16(b):
        return run_in_f32(lambda c_, a_, b_: gemm_ref(c_, a_, b_, trans_a, trans_b, accumulate, alpha),
                          (c, a, b), written=(0,))
    opa = a.swapaxes(-1, -2) if trans_a else a
    opb = b.swapaxes(-1, -2) if trans_b else b
    prod = alpha * (opa @ opb)
    if accumulate:
        c += prod
    else:
        c[...] = prod


# ---- the kernel ----------------------------------------------------------------------------------
def tile_dtype(a):
    """The dtype of a's shared-memory tile: a.dtype for float arrays, float32 for uint16 (bf16 bits): the tile
    holds the loaded values, exactly."""
    return np.float32 if a.dtype == np.uint16 else a.dtype


# on the GPU: chosen while Numba compiles the kernel (cuda.shared.array needs a compile-time dtype)
@overload(tile_dtype, target="cuda")
def _tile_dtype_cuda(a):
    if a.dtype == types.uint16:
        return lambda a: np.float32
    return lambda a: a.dtype


@cuda.jit(device=True)
def op_element(x, z, r, c, R, C, trans):
    """op(x)[z, r, c] (op(x) = x or, when trans, x[z].T), 0.0 outside its R x C."""
    if r < R and c < C:
        return load(x, (z, c, r)) if trans else load(x, (z, r, c))
    return 0.0


@cuda.jit
def gemm_tiled_kernel(c, a, b, trans_a, trans_b, accumulate, alpha):
    # c (Z,M,N) = alpha * op(a) @ op(b) per batch index z, or += that when `accumulate`; op(a) (M,K), op(b)
    # (K,N), so a is (Z,M,K), or (Z,K,M) when trans_a; b is (Z,K,N), or (Z,N,K) when trans_b.
    # Block (bx, by, z) computes the tile c[z, by*TILE:(by+1)*TILE, bx*TILE:(bx+1)*TILE]; thread (tx, ty) one element.
    _, M, N = c.shape
    K = a.shape[1] if trans_a else a.shape[2]
    a_tile = cuda.shared.array((TILE, TILE), dtype=tile_dtype(a))
    b_tile = cuda.shared.array((TILE, TILE), dtype=tile_dtype(b))
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    z = cuda.blockIdx.z
    row0 = cuda.blockIdx.y * TILE
    col0 = cuda.blockIdx.x * TILE
    acc = np.float64(0.0)           # the products of the tiles are summed in double
    for k0 in range(0, K, TILE):
        # stage a_tile = op(a)[row0:+TILE, k0:+TILE] and b_tile = op(b)[k0:+TILE, col0:+TILE], zero past the
        # edges; on a transposed operand the threads swap roles so that consecutive tx read consecutive addresses
        if trans_a:
            a_tile[tx, ty] = op_element(a, z, row0 + tx, k0 + ty, M, K, True)
        else:
            a_tile[ty, tx] = op_element(a, z, row0 + ty, k0 + tx, M, K, False)
        if trans_b:
            b_tile[tx, ty] = op_element(b, z, k0 + tx, col0 + ty, K, N, True)
        else:
            b_tile[ty, tx] = op_element(b, z, k0 + ty, col0 + tx, K, N, False)
        cuda.syncthreads()
        # partial dot product of row ty of a_tile with column tx of b_tile
        for kk in range(TILE):
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()   # everyone is done with the tiles before they are overwritten
    i = row0 + ty
    j = col0 + tx
    if i < M and j < N:
        # overwrite or accumulate (an overwritten c is never read: it may hold NaN). The add is spelled out,
        # c read before the product, as `c[...] += alpha * acc` evaluates: then the compiler keeps the product
        # in this branch and fuses it into the add (one fma)
        if accumulate:
            store(c, (z, i, j), load(c, (z, i, j)) + alpha * acc)
        else:
            store(c, (z, i, j), alpha * acc)


def gemm_tiled(dev, c, a, b, trans_a: bool, trans_b: bool, accumulate: bool, alpha: float = 1.0) -> None:
    """c (+)= alpha * op(a) @ op(b) with the tiled kernel; 2-D arrays are a batch of one."""
    if c.ndim == 2:
        c, a, b = c.reshape(1, *c.shape), a.reshape(1, *a.shape), b.reshape(1, *b.shape)
    Z, M, N = c.shape
    dev.launch(gemm_tiled_kernel, (ceil_div(N, TILE), ceil_div(M, TILE), Z), (TILE, TILE),
               c, a, b, trans_a, trans_b, accumulate, alpha, flops=2 * Z * M * N * (a.size // (Z * M)))


# the teaching set's product (llmz.fast.gemm's gemm chooses between cuBLAS and this kernel)
gemm = gemm_tiled
