"""Matrix multiplication, the linear layer of llm.c (weights stored (out, in)):

    forward    out = inp @ weight.T + bias          inp (N,C), weight (OC,C), bias (OC,), out (N,OC)
    backward   dinp += dout @ weight,  dweight += dout.T @ inp,  dbias += sum over rows of dout

All three products are one generic product  c (+)= op(a) @ op(b)  with op(x) = x or x.T: llmz.kernels.gemm,
which is cuBLAS (TF32 tensor cores) or the tiled teaching kernel, as dev.matmul says. The weight gradient
accumulates straight into the gradient buffer (cuBLAS beta=1). The bias goes in first: a kernel fills every
row of out with the bias, and the product then accumulates onto it (beta=1), so the bias is added inside the
product's epilogue and the result is rounded once (what cuBLASLt's bias epilogue does; both products share
it). The bias gradient is a deterministic two-stage column sum (llmz.kernels.reduce).
  Why not a bias kernel after the product (llm.c's dev/cuda/matmul_forward.cu): it reads and writes out
  again; the fill only writes it. bf16 d12 B=16 T=1024 on the H200: the add-after kernel took 4.14 ms/step
  over 48 launches (657 GB/s of read + write).
dinp may also be overwritten (beta=0, dinp_accumulate=False): the caller then needs no zeroed buffer.

Arrays may be float32, float64 or uint16 (bf16 bits, computed in float32, results rounded to nearest): the
fill kernel reads and writes through llmz.kernels.bf16's load / store; the references go through
llmz.bf16.run_in_f32.
"""
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, pair_view, store
from .gelu import pairs_apply
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


def matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight, dinp_accumulate=True):
    """dout (...,OC), inp and dinp (...,C), weight and dweight (OC,C), dbias (OC,) or None.
    Accumulates (+=) into dinp, dweight and dbias (dinp_accumulate=False: overwrites dinp)."""
    arrays = (dinp, dweight, dbias, dout, inp, weight)
    if any(is_bf16(x) for x in arrays):
        return run_in_f32(lambda *xs: matmul_backward_ref(*xs, dinp_accumulate), arrays, written=(0, 1, 2))
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    # gradient of the input: dout @ weight
    if dinp_accumulate:
        dinp += (dout2 @ weight).reshape(dinp.shape)
    else:
        dinp[...] = (dout2 @ weight).reshape(dinp.shape)
    # gradient of the weight: dout.T @ inp
    dweight += dout2.T @ inp.reshape(-1, C)
    # gradient of the bias: the sum of dout over all rows
    if dbias is not None:
        dbias += dout2.sum(axis=0)


# ---- Numba kernels (the products themselves are llmz.kernels.gemm) --------------------------------
# rows of out one fill thread writes (a grid-stride loop): a block of 256 threads then writes 32 rows, not
# 4 (bf16 d12 B=16 T=1024 on the H200, 4 rows a thread and 2-byte stores: 48 launches, 3.21 ms, 845 GB/s;
# 9,216 to 36,864 blocks of a few microseconds each)
FILL_ROWS = 32


@cuda.jit
def matmul_bias_fill_kernel(out, bias):
    """out (N,OC) = bias (OC,) in every row. Grid (ceil(N/FILL_ROWS), ceil(OC/blockDim)), see bias_grid:
    thread (r, oc) writes rows r, r+S, r+2S, ... (S = gridDim.x) of column oc (the row is the block's, no
    division). Overwrites out; only writes it. On the GPU the layer passes out and bias as paired views
    (llmz.kernels.bf16.pair_view: uint32 or uint64 words of two elements), which load and store copy as
    they are: the same kernel then moves the bias two elements per store."""
    N, OC = out.shape
    oc = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if oc >= OC:
        return
    S = cuda.gridDim.x
    b = load(bias, oc)
    for r in range(cuda.blockIdx.x, N, S):
        store(out, (r, oc), b)


def bias_grid(dev, N: int, OC: int) -> tuple:
    """matmul_bias_fill_kernel's grid for out (N,OC), blocks of dev.block_size threads."""
    return ceil_div(N, FILL_ROWS), ceil_div(OC, dev.block_size)


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def matmul_forward(dev, out, inp, weight, bias) -> None:
    """out (...,OC) = inp (...,C) @ weight (OC,C).T + bias (OC,) (bias may be None). Overwrites out."""
    if not dev.kernels:
        return matmul_forward_ref(out, inp, weight, bias)
    OC, C = weight.shape
    out2 = out.reshape(-1, OC)
    # out = bias in every row, then out += inp (N,C) @ weight.T (C,OC): the sum rounded once
    if bias is not None:
        fill_out, fill_bias = out2, bias
        if out2.dtype == bias.dtype and OC % 2 == 0 and pairs_apply(dev, out2, bias):
            fill_out, fill_bias = pair_view(out2), pair_view(bias)     # words of two elements, copied as they are
        dev.launch(matmul_bias_fill_kernel, bias_grid(dev, *fill_out.shape), dev.block_size, fill_out, fill_bias)
    gemm(dev, out2, inp.reshape(-1, C), weight, False, True, bias is not None)


def matmul_backward(dev, dinp, dweight, dbias, dout, inp, weight, dinp_accumulate: bool = True) -> None:
    """dinp (...,C) += dout @ weight; dweight (OC,C) += dout.T @ inp; dbias (OC,) += dout summed over rows
    (dbias may be None). Accumulates (+=) into all three (dinp_accumulate=False: overwrites dinp)."""
    if not dev.kernels:
        return matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight, dinp_accumulate)
    OC, C = weight.shape
    dout2 = dout.reshape(-1, OC)
    inp2 = inp.reshape(-1, C)
    # dinp (N,C) (+)= dout (N,OC) @ weight (OC,C)
    gemm(dev, dinp.reshape(-1, C), dout2, weight, False, False, dinp_accumulate)
    # dweight (OC,C) += dout.T (OC,N) @ inp (N,C)
    gemm(dev, dweight, dout2, inp2, True, False, True)
    # dbias (OC,) += column sums of dout
    if dbias is not None:
        column_sum(dev, dbias, dout2)
