"""Matrix multiplication, the linear layer of llm.c (weights stored (out, in)):

    forward    out = inp @ weight.T + bias          inp (N,C), weight (OC,C), bias (OC,), out (N,OC)
    backward   dinp += dout @ weight,  dweight += dout.T @ inp,  dbias += sum over rows of dout

All three products are one generic product  c (+)= op(a) @ op(b)  with op(x) = x or x.T: llmz.kernels.gemm,
which is cuBLAS (TF32 tensor cores) or the tiled teaching kernel, as dev.matmul says. The weight gradient
accumulates straight into the gradient buffer (cuBLAS beta=1). The bias is added by its own kernel, as in
llm.c's dev/cuda/matmul_forward.cu, so both products share it (and a Numba kernel on the GPU cannot take
None for an absent bias); the bias gradient is a deterministic two-stage column sum (llmz.kernels.reduce).

Arrays may be float32, float64 or uint16 (bf16 bits, computed in float32, results rounded to nearest): the
bias kernel reads and writes through llmz.kernels.bf16's load / store; the references go through
llmz.bf16.run_in_f32.
"""
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, store
from .gelu import ELEMS_PER_THREAD, loads_barrier
from .gemm import TILE, gemm, gemm_tiled  # noqa: F401  (TILE, gemm_tiled: the teaching kernel, tested here)
from .reduce import column_sum


# ---- NumPy reference ----------------------------------------------------------------------------
def matmul_forward_ref(out, inp, weight, bias):
    """inp (...,C), weight (OC,C), bias (OC,) or None, out (...,OC). Overwrites out."""
    if is_bf16(out) or is_bf16(inp) or is_bf16(weight) or is_bf16(bias):
        return run_in_f32(matmul_forward_ref, (out, inp, weight, bias), written=(0,))
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
    arrays = (dinp, dweight, dbias, dout, inp, weight)
    if any(is_bf16(x) for x in arrays):
        return run_in_f32(matmul_backward_ref, arrays, written=(0, 1, 2))
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    # gradient of the input: dout @ weight
    dinp += (dout2 @ weight).reshape(dinp.shape)
    # gradient of the weight: dout.T @ inp
    dweight += dout2.T @ inp.reshape(-1, C)
    # gradient of the bias: the sum of dout over all rows
    if dbias is not None:
        dbias += dout2.sum(axis=0)


# ---- Numba kernels (the products themselves are llmz.kernels.gemm) --------------------------------
@cuda.jit
def matmul_bias_kernel(out, bias):
    """out (N,OC) += bias (OC,), broadcast over rows. Grid (ceil(N/4), ceil(OC/blockDim)), see bias_grid:
    thread (r, oc) takes rows r, r+S, r+2S, r+3S (S = gridDim.x) of column oc, all loads issued before the
    stores (ELEMS_PER_THREAD = 4 as in llmz.kernels.gelu; the row is the block's, no division). Accumulates
    (+=) into out. (One element per thread, bf16, d12 B=16 T=1024 on the H200: 434 GB/s.)"""
    N, OC = out.shape
    oc = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    S = cuda.gridDim.x
    r0 = cuda.blockIdx.x
    r1, r2, r3 = r0 + S, r0 + 2 * S, r0 + 3 * S
    # the loads first, independent, all in flight at once: the bias once, then the four rows of out (a row
    # or column past the end reads row N-1 or column OC-1, valid addresses, and is never stored)
    c, last = min(oc, OC - 1), N - 1
    b = load(bias, c)
    o0 = load(out, (min(r0, last), c))
    o1 = load(out, (min(r1, last), c))
    o2 = load(out, (min(r2, last), c))
    o3 = load(out, (min(r3, last), c))
    loads_barrier()
    # out += bias, the elements inside the array
    if oc < OC:
        if r0 < N:
            store(out, (r0, oc), o0 + b)
        if r1 < N:
            store(out, (r1, oc), o1 + b)
        if r2 < N:
            store(out, (r2, oc), o2 + b)
        if r3 < N:
            store(out, (r3, oc), o3 + b)


def bias_grid(dev, N: int, OC: int) -> tuple:
    """matmul_bias_kernel's grid for out (N,OC), blocks of dev.block_size threads."""
    return ceil_div(N, ELEMS_PER_THREAD), ceil_div(OC, dev.block_size)


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def matmul_forward(dev, out, inp, weight, bias) -> None:
    """out (...,OC) = inp (...,C) @ weight (OC,C).T + bias (OC,) (bias may be None). Overwrites out."""
    if not dev.kernels:
        return matmul_forward_ref(out, inp, weight, bias)
    OC, C = weight.shape
    out2 = out.reshape(-1, OC)
    # out (N,OC) = inp (N,C) @ weight.T (C,OC)
    gemm(dev, out2, inp.reshape(-1, C), weight, False, True, False)
    # out += bias
    if bias is not None:
        dev.launch(matmul_bias_kernel, bias_grid(dev, out2.shape[0], OC), dev.block_size, out2, bias)


def matmul_backward(dev, dinp, dweight, dbias, dout, inp, weight) -> None:
    """dinp (...,C) += dout @ weight; dweight (OC,C) += dout.T @ inp; dbias (OC,) += dout summed over rows
    (dbias may be None). Accumulates (+=) into all three."""
    if not dev.kernels:
        return matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight)
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    inp2 = inp.reshape(-1, C)
    # dinp (N,C) += dout (N,OC) @ weight (OC,C)
    gemm(dev, dinp.reshape(-1, C), dout2, weight, False, False, True)
    # dweight (OC,C) += dout.T (OC,N) @ inp (N,C)
    gemm(dev, dweight, dout2, inp2, True, False, True)
    # dbias (OC,) += column sums of dout
    if dbias is not None:
        column_sum(dev, dbias, dout2)
