"""LayerNorm over the last axis (channels), as llm.c's train_gpt2.c layernorm_forward / layernorm_backward
(eps = 1e-5, biased variance):

    mean = (1/C) sum_i x_i,   rstd = 1 / sqrt((1/C) sum_i (x_i - mean)^2 + eps)
    norm_i = (x_i - mean) * rstd,   out_i = norm_i * w_i + b_i
    backward, with dnorm_i = w_i * dout_i:
    dx_i = rstd * (dnorm_i - mean_j(dnorm_j) - norm_i * mean_j(dnorm_j * norm_j))
    dw_i = sum over rows of norm_i * dout_i,   db_i = sum over rows of dout_i

inp, out, dinp, dout: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,), kept for backward; weight, bias, dweight,
dbias: (C,). Kernels, every sum in float64 and in a fixed order (the same bits every run):
  forward          one block per row; threads stride over C; two shared-memory reductions (the mean, then the
                   variance); overwrites out, mean, rstd
  backward, rows   one block per row; two reductions (the two means above); accumulates (+=) into dinp
  backward, params one thread per channel, looping over the rows in order; accumulates into dweight, dbias
inp, out, dinp, dout, weight, bias, dweight, dbias are float32, float64 or uint16 (bf16 bits, computed in
float32, results rounded to nearest), each on its own, through llmz.kernels.bf16's load / store / store_add.
mean and rstd keep the dtype they are given (float32 beside bf16 activations).
"""
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store, store_add
from .grid import ceil_div
from .norm import MAX_BLOCK, block_total

LN_EPS = 1e-5


# ---- NumPy reference ----------------------------------------------------------------------------
def layernorm_forward_ref(out, mean, rstd, inp, weight, bias):
    """inp, out: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,), kept for backward; weight, bias: (C,).
    Overwrites out, mean, rstd."""
    if is_bf16(out) or is_bf16(inp) or is_bf16(weight) or is_bf16(bias):
        # mean, rstd: float arrays, written in place
        return run_in_f32(layernorm_forward_ref, (out, mean, rstd, inp, weight, bias), written=(0, 1, 2))
    # the mean over channels
    m = inp.mean(axis=-1, keepdims=True)
    # the biased variance, and its reciprocal standard deviation
    xc = inp - m
    s = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + LN_EPS)
    # normalize, then scale and shift
    out[...] = xc * s * weight + bias
    # cache for backward
    mean[...] = m[..., 0]
    rstd[...] = s[..., 0]


def layernorm_backward_ref(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """dout, inp, dinp: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,); weight, dweight, dbias: (C,).
    Accumulates (+=) into dinp, dweight, dbias."""
    arrays = (dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    if any(is_bf16(a) for a in arrays):
        return run_in_f32(layernorm_backward_ref, arrays, written=(0, 1, 2))
    C = inp.shape[-1]
    m = mean[..., None]
    s = rstd[..., None]
    # recompute the normalized input
    norm = (inp - m) * s
    dnorm = weight * dout
    # parameter gradients: sums over all rows
    dbias += dout.reshape(-1, C).sum(axis=0)
    dweight += (norm * dout).reshape(-1, C).sum(axis=0)
    # input gradient: dnorm minus its mean, minus norm times the mean of dnorm * norm, times rstd
    dnorm_mean = dnorm.mean(axis=-1, keepdims=True)
    dnorm_norm_mean = (dnorm * norm).mean(axis=-1, keepdims=True)
    dinp += s * (dnorm - dnorm_mean - norm * dnorm_norm_mean)


# ---- Numba kernels ------------------------------------------------------------------------------
@cuda.jit
def layernorm_forward_kernel(out, mean, rstd, inp, weight, bias):
    """inp, out: (N,C); mean, rstd: (N,); weight, bias: (C,). One block per row. Overwrites out, mean, rstd."""
    C = inp.shape[1]
    row = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    channels = range(cuda.threadIdx.x, C, cuda.blockDim.x)         # this thread's
    # the mean over channels: per-thread partial sums, then the block's tree
    acc = np.float64(0.0)
    for i in channels:
        acc += load(inp, (row, i))
    m = block_total(buf, acc, False) / C
    # the biased variance, a second pass over the row
    acc = np.float64(0.0)
    for i in channels:
        d = load(inp, (row, i)) - m
        acc += d * d
    s = 1.0 / math.sqrt(block_total(buf, acc, False) / C + LN_EPS)
    # normalize, then scale and shift
    for i in channels:
        store(out, (row, i), (load(inp, (row, i)) - m) * s * load(weight, i) + load(bias, i))
    # cache for backward
    if cuda.threadIdx.x == 0:
        mean[row] = m
        rstd[row] = s


@cuda.jit
def layernorm_backward_inp_kernel(dinp, dout, inp, weight, mean, rstd):
    """dinp, dout, inp: (N,C); weight: (C,); mean, rstd: (N,). One block per row. Accumulates (+=) into dinp."""
    C = inp.shape[1]
    row = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    channels = range(cuda.threadIdx.x, C, cuda.blockDim.x)
    m = mean[row]
    s = rstd[row]
    # the two means over the row: of dnorm = weight * dout, and of dnorm * norm
    acc_d = np.float64(0.0)
    acc_dn = np.float64(0.0)
    for i in channels:
        norm = (load(inp, (row, i)) - m) * s
        dnorm = load(weight, i) * load(dout, (row, i))
        acc_d += dnorm
        acc_dn += dnorm * norm
    dnorm_mean = block_total(buf, acc_d, False) / C
    dnorm_norm_mean = block_total(buf, acc_dn, False) / C
    # the input gradient
    for i in channels:
        norm = (load(inp, (row, i)) - m) * s
        dnorm = load(weight, i) * load(dout, (row, i))
        store_add(dinp, (row, i), s * (dnorm - dnorm_mean - norm * dnorm_norm_mean))


@cuda.jit
def layernorm_backward_params_kernel(dweight, dbias, dout, inp, mean, rstd):
    """dweight, dbias: (C,); dout, inp: (N,C); mean, rstd: (N,). One thread per channel c, summing norm * dout
    and dout over the rows in order, in float64. Accumulates (+=) into dweight, dbias."""
    N, C = inp.shape
    c = cuda.grid(1)
    if c < C:
        acc_w = np.float64(0.0)
        acc_b = np.float64(0.0)
        for row in range(N):
            g = load(dout, (row, c))
            acc_w += (load(inp, (row, c)) - mean[row]) * rstd[row] * g
            acc_b += g
        store_add(dweight, c, acc_w)
        store_add(dbias, c, acc_b)


# ---- the layer: the kernels' launches -----------------------------------------------------------
def layernorm_forward(dev, out, mean, rstd, inp, weight, bias) -> None:
    """out, inp: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,); weight, bias: (C,). Overwrites out, mean, rstd."""
    C = inp.shape[-1]
    dev.launch(layernorm_forward_kernel, inp.size // C, dev.block_size,
               out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C), weight, bias)


def layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """Accumulates (+=) into dinp (B,T,C) or (N,C), dweight (C,), dbias (C,)."""
    C = inp.shape[-1]
    dout2, inp2, mean1, rstd1 = dout.reshape(-1, C), inp.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    dev.launch(layernorm_backward_inp_kernel, inp2.shape[0], dev.block_size,
               dinp.reshape(-1, C), dout2, inp2, weight, mean1, rstd1)
    dev.launch(layernorm_backward_params_kernel, ceil_div(C, dev.block_size), dev.block_size,
               dweight, dbias, dout2, inp2, mean1, rstd1)
