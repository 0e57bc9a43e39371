"""LayerNorm over the last axis (channels), as llm.c's train_gpt2.c computes it (eps = 1e-5, biased variance):

    mean = (1/C) sum_i x_i,   rstd = 1 / sqrt((1/C) sum_i (x_i - mean)^2 + eps)
    norm_i = (x_i - mean) * rstd,   out_i = norm_i * w_i + b_i
    backward, with dnorm_i = w_i * dout_i:
    dx_i = rstd * (dnorm_i - mean_j(dnorm_j) - norm_i * mean_j(dnorm_j * norm_j))
    dw_i = sum over rows of norm_i * dout_i,   db_i = sum over rows of dout_i

Kernels (the teaching versions):
  forward          one block per row; threads stride over C; two shared-memory reductions (mean, then variance)
  backward, rows   one block per row; two shared-memory reductions (the two means above), then dinp += ...
  backward, params one thread per channel looping over all rows in order: deterministic, no atomics
Sums are accumulated in float64 (registers and shared memory) whatever the input dtype; the block's
threads are summed by norm.block_sum, a tree in a fixed order (deterministic).
"""
import math

import numba
import numpy as np
from numba import cuda

from ..device import ceil_div
from .norm import MAX_BLOCK, block_sum

LN_EPS = 1e-5


# ---- NumPy reference ----------------------------------------------------------------------------
def layernorm_forward_ref(out, mean, rstd, inp, weight, bias):
    """inp, out: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,), kept for backward; weight, bias: (C,).
    Overwrites out, mean, rstd."""
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
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # the mean over channels: per-thread partial sums, then the block's tree
    acc = 0.0
    for i in range(tid, C, nt):
        acc += inp[row, i]
    buf[tid] = acc
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    m = buf[0] / C
    cuda.syncthreads()                  # everyone has read buf[0] before buf is reused
    # the biased variance, a second pass over the row
    acc = 0.0
    for i in range(tid, C, nt):
        d = inp[row, i] - m
        acc += d * d
    buf[tid] = acc
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    s = 1.0 / math.sqrt(buf[0] / C + LN_EPS)
    # normalize, then scale and shift
    for i in range(tid, C, nt):
        out[row, i] = (inp[row, i] - m) * s * weight[i] + bias[i]
    # cache for backward
    if tid == 0:
        mean[row] = m
        rstd[row] = s


@cuda.jit
def layernorm_backward_inp_kernel(dinp, dout, inp, weight, mean, rstd):
    """dinp, dout, inp: (N,C); weight: (C,); mean, rstd: (N,). One block per row. Accumulates (+=) into dinp."""
    C = inp.shape[1]
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    m = mean[row]
    s = rstd[row]
    # the two means over the row: of dnorm = weight * dout, and of dnorm * norm
    acc_d = 0.0
    acc_dn = 0.0
    for i in range(tid, C, nt):
        norm = (inp[row, i] - m) * s
        dnorm = weight[i] * dout[row, i]
        acc_d += dnorm
        acc_dn += dnorm * norm
    buf[tid] = acc_d
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    dnorm_mean = buf[0] / C
    cuda.syncthreads()                  # everyone has read buf[0] before buf is reused
    buf[tid] = acc_dn
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    dnorm_norm_mean = buf[0] / C
    # the input gradient
    for i in range(tid, C, nt):
        norm = (inp[row, i] - m) * s
        dnorm = weight[i] * dout[row, i]
        dinp[row, i] += s * (dnorm - dnorm_mean - norm * dnorm_norm_mean)


@cuda.jit
def layernorm_backward_params_kernel(dweight, dbias, dout, inp, mean, rstd):
    """dweight, dbias: (C,); dout, inp: (N,C); mean, rstd: (N,). One thread per channel, rows summed in order.
    Accumulates (+=) into dweight, dbias."""
    N, C = inp.shape
    c = cuda.grid(1)
    if c < C:
        acc_w = 0.0
        acc_b = 0.0
        for row in range(N):
            # dbias: sum of dout; dweight: sum of norm * dout
            norm = (inp[row, c] - mean[row]) * rstd[row]
            acc_w += norm * dout[row, c]
            acc_b += dout[row, c]
        dweight[c] += acc_w
        dbias[c] += acc_b


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def layernorm_forward(dev, out, mean, rstd, inp, weight, bias) -> None:
    """out, inp: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,); weight, bias: (C,). Overwrites out, mean, rstd."""
    if not dev.kernels:
        return layernorm_forward_ref(out, mean, rstd, inp, weight, bias)
    C = inp.shape[-1]
    rows = inp.size // C
    bs = dev.block_size
    dev.launch(layernorm_forward_kernel, rows, bs,
               out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C), weight, bias)


def layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """Accumulates (+=) into dinp (B,T,C) or (N,C), dweight (C,), dbias (C,)."""
    if not dev.kernels:
        return layernorm_backward_ref(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    C = inp.shape[-1]
    rows = inp.size // C
    bs = dev.block_size
    dout2, inp2, mean1, rstd1 = dout.reshape(-1, C), inp.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    dev.launch(layernorm_backward_inp_kernel, rows, bs,
               dinp.reshape(-1, C), dout2, inp2, weight, mean1, rstd1)
    dev.launch(layernorm_backward_params_kernel, ceil_div(C, bs), bs,
               dweight, dbias, dout2, inp2, mean1, rstd1)
