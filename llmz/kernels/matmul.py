"""Matrix multiplication, the linear layer of llm.c (matmul_forward / matmul_backward; weights stored (out, in)):

    forward    out = inp @ weight.T + bias          inp (N,C), weight (OC,C), bias (OC,), out (N,OC)
    backward   dinp += dout @ weight,  dweight += dout.T @ inp,  dbias += sum over rows of dout

inp and out may be (B,T,C) and (B,T,OC): the rows are B*T. The three products are llmz.kernels.gemm's tiled
kernel. The bias goes in first: one thread per element of out writes the bias, and the product then
accumulates onto it, so out = bias + product is rounded once. The bias gradient: one thread per column,
adding the rows in order in float64. matmul_forward overwrites out; matmul_backward accumulates (+=) into
dinp, dweight and dbias (dinp_accumulate=False overwrites dinp: the caller then needs no zeroed buffer).
bias and dbias may be None. Arrays are float32, float64 or uint16 (bf16 bits, computed in float32, results
rounded to nearest), through llmz.kernels.bf16's load / store / store_add.
"""
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store, store_add
from .gemm import gemm
from .grid import ceil_div


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
@cuda.jit
def matmul_forward_bias_kernel(out, bias):
    """out (N,OC) = bias (OC,) in every row: one thread per element. Overwrites out."""
    N, OC = out.shape
    i = cuda.grid(1)
    if i < N * OC:
        store(out, (i // OC, i % OC), load(bias, i % OC))


@cuda.jit
def matmul_backward_bias_kernel(dbias, dout):
    """dbias (OC,) += the column sums of dout (N,OC): one thread per column, the rows in order, in float64.
    Accumulates."""
    N, OC = dout.shape
    oc = cuda.grid(1)
    if oc < OC:
        acc = np.float64(0.0)
        for row in range(N):
            acc += load(dout, (row, oc))
        store_add(dbias, oc, acc)


# ---- the layer: the kernels' launches -----------------------------------------------------------
def matmul_forward(dev, out, inp, weight, bias) -> None:
    """out (...,OC) = inp (...,C) @ weight (OC,C).T + bias (OC,) (bias may be None). Overwrites out."""
    OC, C = weight.shape
    out2 = out.reshape(-1, OC)
    # out = bias in every row, then out += inp (N,C) @ weight.T (C,OC): the sum rounded once
    if bias is not None:
        dev.launch(matmul_forward_bias_kernel, ceil_div(out2.size, dev.block_size), dev.block_size, out2, bias)
    gemm(dev, out2, inp.reshape(-1, C), weight, False, True, bias is not None)


def matmul_backward(dev, dinp, dweight, dbias, dout, inp, weight, dinp_accumulate: bool = True) -> None:
    """dinp (...,C) += dout @ weight; dweight (OC,C) += dout.T @ inp; dbias (OC,) += dout summed over rows
    (dbias may be None). Accumulates (+=) into all three (dinp_accumulate=False: overwrites dinp)."""
    OC = weight.shape[0]
    dout2 = dout.reshape(-1, OC)
    backward_products(dev, gemm, dinp, dweight, dout2, inp, weight, dinp_accumulate)
    # dbias (OC,) += column sums of dout
    if dbias is not None:
        dev.launch(matmul_backward_bias_kernel, ceil_div(OC, dev.block_size), dev.block_size, dbias, dout2)


def backward_products(dev, product, dinp, dweight, dout2, inp, weight, dinp_accumulate: bool) -> None:
    """The two products of matmul_backward, each on `product` (this file's tiled gemm; llmz.fast.matmul passes
    llmz.fast.gemm's, cuBLAS where --matmul says). dout2: dout as (N,OC) rows."""
    C = weight.shape[1]
    # dinp (N,C) (+)= dout (N,OC) @ weight (OC,C)
    product(dev, dinp.reshape(-1, C), dout2, weight, False, False, dinp_accumulate)
    # dweight (OC,C) += dout.T (OC,N) @ inp (N,C)
    product(dev, dweight, dout2, inp.reshape(-1, C), True, False, True)
