"""The linear layer's fast path (llm.c's llmc/matmul.cuh role). The math, shapes and dtypes are
llmz/kernels/matmul.py's; each piece replaces one there:

  products   llmz.fast.gemm: cuBLAS (TF32 / bf16 tensor cores; the weight gradient accumulated with beta=1)
             in place of the tiled teaching kernel, as dev.matmul says (--matmul)
  bias       matmul_bias_fill_kernel replaces matmul_forward_bias_kernel (one thread per element): each
             thread writes FILL_ROWS = 32 rows of one column (a grid-stride loop: 32x fewer blocks), on words
             of two elements where out and bias fit (pair_view); the product then accumulates onto it, so the
             bias is added inside the product's epilogue and the sum rounded once (what cuBLASLt's bias
             epilogue does)
  bias grad  llmz.fast.column_sum (two stages in one launch) replaces matmul_backward_bias_kernel (one thread
             per column over all rows)
Contract: the bias fill writes the teaching kernel's bits; the bias gradient is column_sum's (a float64 sum
in another order: within one rounding); the products are cuBLAS's (llmz.fast.gemm: full fp32 within 1e-6 of
float64 like the tiled kernel, TF32 ~1e-3).
"""
from numba import cuda

from ..kernels.bf16 import load, store
from ..kernels.grid import ceil_div
from ..kernels.matmul import backward_products
from .column_sum import column_sum
from .device_helpers import pair_view, pairs_apply
from .gemm import gemm

# rows of out one fill thread writes (a grid-stride loop): a block of 256 threads then writes 32 rows, not 4
FILL_ROWS = 32


# ---- Numba kernel ------------------------------------------------------------------------------------------
@cuda.jit
def matmul_bias_fill_kernel(out, bias):
    """out (N,OC) = bias (OC,) in every row. Grid (ceil(N/FILL_ROWS), ceil(OC/blockDim)), see bias_grid:
    thread (r, oc) writes rows r, r+S, r+2S, ... (S = gridDim.x) of column oc (the row is the block's, no
    division). Overwrites out; only writes it. The layer passes out and bias as paired views where they
    fit (pair_view: uint32 or uint64 words of two elements), which load and store copy as they are: the same
    kernel then moves the bias two elements per store."""
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


# ---- the layer ---------------------------------------------------------------------------------
def matmul_forward(dev, out, inp, weight, bias) -> None:
    """out (...,OC) = inp (...,C) @ weight (OC,C).T + bias (OC,) (bias may be None). Overwrites out."""
    OC, C = weight.shape
    out2 = out.reshape(-1, OC)
    # out = bias in every row, then out += inp (N,C) @ weight.T (C,OC): the sum rounded once
    if bias is not None:
        fill_out, fill_bias = out2, bias
        if out2.dtype == bias.dtype and OC % 2 == 0 and pairs_apply(out2, bias):
            fill_out, fill_bias = pair_view(out2), pair_view(bias)     # words of two elements, copied as they are
        dev.launch(matmul_bias_fill_kernel, bias_grid(dev, *fill_out.shape), dev.block_size, fill_out, fill_bias)
    gemm(dev, out2, inp.reshape(-1, C), weight, False, True, bias is not None)


def matmul_backward(dev, dinp, dweight, dbias, dout, inp, weight, dinp_accumulate: bool = True) -> None:
    """dinp (...,C) += dout @ weight; dweight (OC,C) += dout.T @ inp; dbias (OC,) += dout summed over rows
    (dbias may be None). Accumulates (+=) into all three (dinp_accumulate=False: overwrites dinp)."""
    dout2 = dout.reshape(-1, weight.shape[0])
    # the teaching backward's two products, on this set's gemm
    backward_products(dev, gemm, dinp, dweight, dout2, inp, weight, dinp_accumulate)
    # dbias (OC,) += column sums of dout
    if dbias is not None:
        column_sum(dev, dbias, dout2)
