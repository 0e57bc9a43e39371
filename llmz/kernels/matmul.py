"""Matrix multiplication, the linear layer of llm.c (weights stored (out, in)):

    forward    out = inp @ weight.T + bias          inp (N,C), weight (OC,C), bias (OC,), out (N,OC)
    backward   dinp += dout @ weight,  dweight += dout.T @ inp,  dbias += sum over rows of dout

All three products are one generic product  c (+)= op(a) @ op(b)  with op(x) = x or x.T, done by
`gemm_tiled` (the teaching version: TILE x TILE tiles staged through shared memory). A cuBLAS version
(`gemm_cublas`, through CuPy) can sit beside it with the same arguments; the layer functions are the only
callers. The bias is added by its own kernel, as in llm.c's dev/cuda/matmul_forward.cu, so the tiled and the
cuBLAS products can share it (and a Numba kernel on the GPU cannot take None for an absent bias).
"""
import numpy as np
from numba import cuda

from ..device import ceil_div

TILE = 16   # the kernel's blocks are TILE x TILE threads; each block computes one TILE x TILE tile of c


# ---- NumPy reference ----------------------------------------------------------------------------
def matmul_forward_ref(out, inp, weight, bias):
    """inp (...,C), weight (OC,C), bias (OC,) or None, out (...,OC). Overwrites out."""
    OC, C = weight.shape
    out2 = out.reshape(-1, OC)
    # out = inp @ weight.T
    np.matmul(inp.reshape(-1, C), weight.T, out=out2)
    # + bias, broadcast over rows
    if bias is not None:
        out2 += bias


def matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight):
    """dout (...,OC), inp and dinp (...,C), weight and dweight (OC,C), dbias (OC,) or None.
    Accumulates (+=) into dinp, dweight and dbias."""
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    # gradient of the input: dout @ weight
    dinp += (dout2 @ weight).reshape(dinp.shape)
    # gradient of the weight: dout.T @ inp
    dweight += dout2.T @ inp.reshape(-1, C)
    # gradient of the bias: the sum of dout over all rows
    if dbias is not None:
        dbias += dout2.sum(axis=0)


# ---- Numba kernels ------------------------------------------------------------------------------
@cuda.jit
def gemm_tiled_kernel(c, a, b, trans_a, trans_b, accumulate):
    # c (M,N) = op(a) @ op(b), or += that when `accumulate`; op(a) is (M,K), op(b) is (K,N),
    # so a is (M,K), or (K,M) when trans_a; b is (K,N), or (N,K) when trans_b.
    # Block (bx, by) computes the tile c[by*TILE:(by+1)*TILE, bx*TILE:(bx+1)*TILE]; thread (tx, ty) one element.
    M, N = c.shape
    K = a.shape[0] if trans_a else a.shape[1]
    a_tile = cuda.shared.array((TILE, TILE), dtype=a.dtype)
    b_tile = cuda.shared.array((TILE, TILE), dtype=b.dtype)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    row0 = cuda.blockIdx.y * TILE
    col0 = cuda.blockIdx.x * TILE
    acc = 0.0           # Numba types this float64: products of the tiles are summed in double
    for k0 in range(0, K, TILE):
        # stage a_tile = op(a)[row0:+TILE, k0:+TILE] and b_tile = op(b)[k0:+TILE, col0:+TILE], zero past the
        # edges; on a transposed operand the threads swap roles so that consecutive tx read consecutive addresses
        if trans_a:
            i, k = row0 + tx, k0 + ty
            a_tile[tx, ty] = a[k, i] if i < M and k < K else 0.0
        else:
            i, k = row0 + ty, k0 + tx
            a_tile[ty, tx] = a[i, k] if i < M and k < K else 0.0
        if trans_b:
            j, k = col0 + ty, k0 + tx
            b_tile[tx, ty] = b[j, k] if j < N and k < K else 0.0
        else:
            j, k = col0 + tx, k0 + ty
            b_tile[ty, tx] = b[k, j] if j < N and k < K else 0.0
        cuda.syncthreads()
        # partial dot product of row ty of a_tile with column tx of b_tile
        for kk in range(TILE):
            acc += a_tile[ty, kk] * b_tile[kk, tx]
        cuda.syncthreads()   # everyone is done with the tiles before they are overwritten
    i = row0 + ty
    j = col0 + tx
    if i < M and j < N:
        # overwrite or accumulate (an overwritten c is never read: it may hold NaN)
        if accumulate:
            c[i, j] += acc
        else:
            c[i, j] = acc


@cuda.jit
def matmul_bias_kernel(out, bias):
    # out (N,OC) += bias (OC,), broadcast over rows. One thread per element of out.
    idx = cuda.grid(1)
    N, OC = out.shape
    if idx < N * OC:
        out[idx // OC, idx % OC] += bias[idx % OC]


@cuda.jit
def matmul_dbias_kernel(dbias, dout):
    # dout (N,OC), dbias (OC,); accumulates (+=) the column sums of dout into dbias.
    # One thread per column, summing the rows in order: deterministic, no atomics.
    oc = cuda.grid(1)
    N, OC = dout.shape
    if oc < OC:
        acc = 0.0
        for n in range(N):
            acc += dout[n, oc]
        dbias[oc] += acc


# ---- the products: one function each way of computing them ----------------------------------------
def gemm_tiled(dev, c, a, b, trans_a: bool, trans_b: bool, accumulate: bool) -> None:
    """c (M,N) = op(a) @ op(b), overwriting c, or accumulating (+=) when `accumulate`.
    a, b, c are contiguous 2-D arrays; op(x) is x.T when trans_x."""
    M, N = c.shape
    dev.launch(gemm_tiled_kernel, (ceil_div(N, TILE), ceil_div(M, TILE)), (TILE, TILE),
               c, a, b, trans_a, trans_b, accumulate)


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def matmul_forward(dev, out, inp, weight, bias) -> None:
    """out (...,OC) = inp (...,C) @ weight (OC,C).T + bias (OC,) (bias may be None). Overwrites out."""
    if not dev.kernels:
        return matmul_forward_ref(out, inp, weight, bias)
    OC, C = weight.shape
    out2 = out.reshape(-1, OC)
    # out (N,OC) = inp (N,C) @ weight.T (C,OC)
    gemm_tiled(dev, out2, inp.reshape(-1, C), weight, False, True, False)
    # out += bias
    if bias is not None:
        dev.launch(matmul_bias_kernel, ceil_div(out2.size, dev.block_size), dev.block_size, out2, bias)


def matmul_backward(dev, dinp, dweight, dbias, dout, inp, weight) -> None:
    """dinp (...,C) += dout @ weight; dweight (OC,C) += dout.T @ inp; dbias (OC,) += dout summed over rows
    (dbias may be None). Accumulates (+=) into all three."""
    if not dev.kernels:
        return matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight)
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    inp2 = inp.reshape(-1, C)
    # dinp (N,C) += dout (N,OC) @ weight (OC,C)
    gemm_tiled(dev, dinp.reshape(-1, C), dout2, weight, False, False, True)
    # dweight (OC,C) += dout.T (OC,N) @ inp (N,C)
    gemm_tiled(dev, dweight, dout2, inp2, True, False, True)
    # dbias (OC,) += column sums of dout
    if dbias is not None:
        dev.launch(matmul_dbias_kernel, ceil_div(OC, dev.block_size), dev.block_size, dbias, dout2)
