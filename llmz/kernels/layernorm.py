"""LayerNorm over the last axis (channels), as llm.c's train_gpt2.c computes it (eps = 1e-5, biased variance):

    mean = (1/C) sum_i x_i,   rstd = 1 / sqrt((1/C) sum_i (x_i - mean)^2 + eps)
    norm_i = (x_i - mean) * rstd,   out_i = norm_i * w_i + b_i
    backward, with dnorm_i = w_i * dout_i:
    dx_i = rstd * (dnorm_i - mean_j(dnorm_j) - norm_i * mean_j(dnorm_j * norm_j))
    dw_i = sum over rows of norm_i * dout_i,   db_i = sum over rows of dout_i

Kernels (the teaching versions):
  forward          one block per row; threads stride over C; two shared-memory reductions (mean, then variance)
  backward, rows   one block per row; two shared-memory reductions (the two means above), then dinp += ...
  backward, params two stages (reduce.py's column-sum pattern): stage 1, grid (ceil(C/32), ceil(N/256)),
                   each block sums norm*dout and dout over a chunk of rows for a strip of 32 channels into two
                   float64 (R,C) scratch buffers; stage 2, one thread per channel adds the R partials in order.
                   It replaced one thread per channel looping over all N rows (only C threads in flight).
Fast versions, GPU only (the simulator has no warp shuffles; it runs the teaching versions above):
  forward, warp    one WARP per row, blockDim/32 rows per block: the same three passes (mean, variance,
                   write), each row-sum a butterfly of warp shuffles instead of a shared-memory tree with a
                   __syncthreads per level; the re-reads of the row hit L1. Replaces 256 threads with 3
                   channels each at C=768 (before: 5.07 ms per d12 step for 25 calls, ~500 GB/s).
  backward, warp   the rows part the same way, both means in one read of the row (before: 4.55 ms, ~830 GB/s).
Sums are accumulated in float64 (registers and shared memory) whatever the input dtype; the block's
threads are summed in a fixed order (norm.block_sum's tree, reduce.strip_partial's lanes, warp_sum's
butterfly): deterministic.

inp, out, dinp, dout, weight, bias, dweight, dbias are float32, float64 or uint16 (bf16 bits, computed in
float32, results rounded to nearest), each on its own: the kernels read and write them through
llmz.kernels.bf16's load / store / store_add. mean and rstd are statistics: they keep the dtype they are given
(float32 beside bf16 activations), read and written directly, as are the float64 partial sums.
"""
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, store, store_add
from .norm import MAX_BLOCK, block_sum
from .reduce import COLSUM_STRIP, MAX_LANES, colsum_geometry, stage_rows, strip_partial, sum_partials

LN_EPS = 1e-5
WARP = 32                   # threads per warp: the fast kernels give each row one warp
FULL_MASK = 0xFFFFFFFF      # every lane of the warp takes part in the shuffle


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
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # the mean over channels: per-thread partial sums, then the block's tree
    acc = 0.0
    for i in range(tid, C, nt):
        acc += load(inp, (row, i))
    buf[tid] = acc
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    m = buf[0] / C
    cuda.syncthreads()                  # everyone has read buf[0] before buf is reused
    # the biased variance, a second pass over the row
    acc = 0.0
    for i in range(tid, C, nt):
        d = load(inp, (row, i)) - m
        acc += d * d
    buf[tid] = acc
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    s = 1.0 / math.sqrt(buf[0] / C + LN_EPS)
    # normalize, then scale and shift
    for i in range(tid, C, nt):
        store(out, (row, i), (load(inp, (row, i)) - m) * s * load(weight, i) + load(bias, i))
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
        norm = (load(inp, (row, i)) - m) * s
        dnorm = load(weight, i) * load(dout, (row, i))
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
        norm = (load(inp, (row, i)) - m) * s
        dnorm = load(weight, i) * load(dout, (row, i))
        store_add(dinp, (row, i), s * (dnorm - dnorm_mean - norm * dnorm_norm_mean))


@cuda.jit
def layernorm_backward_params_partial_kernel(part_w, part_b, dout, inp, mean, rstd, rows_per_block):
    """part_w, part_b: (R,C) float64; dout, inp: (N,C); mean, rstd: (N,). Stage 1, grid (ceil(C/32), R),
    block (32, lanes): block (x, y) sums rows [y*rows_per_block, (y+1)*rows_per_block) of channels
    [32x, 32x+32). Overwrites part_w[y], part_b[y] there."""
    N, C = inp.shape
    buf = cuda.shared.array((MAX_LANES, COLSUM_STRIP), numba.float64)
    c, first, end, step = stage_rows(N, rows_per_block)
    acc_w = 0.0
    acc_b = 0.0
    if c < C:
        for row in range(first, end, step):
            # dbias: sum of dout; dweight: sum of norm * dout
            norm = (load(inp, (row, c)) - mean[row]) * rstd[row]
            g = load(dout, (row, c))
            acc_w += norm * g
            acc_b += g
    # the block's lanes, in order
    strip_partial(buf, acc_w, part_w, c)
    strip_partial(buf, acc_b, part_b, c)


@cuda.jit
def layernorm_backward_params_final_kernel(dweight, dbias, part_w, part_b):
    """dweight, dbias: (C,); part_w, part_b: (R,C) float64. Stage 2, one thread per channel, the R chunks
    summed in order. Accumulates (+=) into dweight, dbias."""
    c = cuda.grid(1)
    if c < dweight.shape[0]:
        store_add(dweight, c, sum_partials(part_w, c))
        store_add(dbias, c, sum_partials(part_b, c))


# ---- fast Numba kernels, GPU only: one warp per row --------------------------------------------
@cuda.jit(device=True)
def warp_sum(v):
    """The sum of v over the 32 lanes of a warp, returned in every lane. An xor butterfly: lane i adds the
    value of lane i^16, then i^8, i^4, i^2, i^1; each pair adds the same two numbers, so every lane ends with
    the same bits, and the order is the same every run. All 32 lanes must call it."""
    offset = WARP // 2
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        offset //= 2
    return v


@cuda.jit(device=True)
def warp_row():
    """(row, lane) of this thread: warp w of block b takes row b * (blockDim/32) + w. The warps past the last
    row leave as a whole warp, so no shuffle ever misses a lane."""
    tid = cuda.threadIdx.x
    return cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP, tid % WARP


@cuda.jit
def layernorm_forward_warp_kernel(out, mean, rstd, inp, weight, bias):
    """inp, out: (N,C); mean, rstd: (N,); weight, bias: (C,). One warp per row, blockDim/32 rows per block.
    Overwrites out, mean, rstd."""
    N, C = inp.shape
    row, lane = warp_row()
    if row >= N:
        return
    # the mean over channels: each lane's strided partial sum (float64), then the warp's butterfly
    acc = 0.0
    for i in range(lane, C, WARP):
        acc += load(inp, (row, i))
    m = warp_sum(acc) / C
    # the biased variance, a second pass over the row (from L1)
    acc = 0.0
    for i in range(lane, C, WARP):
        d = load(inp, (row, i)) - m
        acc += d * d
    s = 1.0 / math.sqrt(warp_sum(acc) / C + LN_EPS)
    # normalize, then scale and shift
    for i in range(lane, C, WARP):
        store(out, (row, i), (load(inp, (row, i)) - m) * s * load(weight, i) + load(bias, i))
    # cache for backward
    if lane == 0:
        mean[row] = m
        rstd[row] = s


@cuda.jit
def layernorm_backward_inp_warp_kernel(dinp, dout, inp, weight, mean, rstd):
    """dinp, dout, inp: (N,C); weight: (C,); mean, rstd: (N,). One warp per row, blockDim/32 rows per block.
    Accumulates (+=) into dinp."""
    N, C = inp.shape
    row, lane = warp_row()
    if row >= N:
        return
    m = mean[row]
    s = rstd[row]
    # the two means over the row, of dnorm = weight * dout and of dnorm * norm: one read, two butterflies
    acc_d = 0.0
    acc_dn = 0.0
    for i in range(lane, C, WARP):
        norm = (load(inp, (row, i)) - m) * s
        dnorm = load(weight, i) * load(dout, (row, i))
        acc_d += dnorm
        acc_dn += dnorm * norm
    dnorm_mean = warp_sum(acc_d) / C
    dnorm_norm_mean = warp_sum(acc_dn) / C
    # the input gradient
    for i in range(lane, C, WARP):
        norm = (load(inp, (row, i)) - m) * s
        dnorm = load(weight, i) * load(dout, (row, i))
        store_add(dinp, (row, i), s * (dnorm - dnorm_mean - norm * dnorm_norm_mean))


def warp_rows_geometry(dev, rows: int) -> tuple[int, int]:
    """(grid, block) of the warp-per-row kernels: dev.block_size threads = block_size/32 rows per block."""
    return ceil_div(rows, dev.block_size // WARP), dev.block_size


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def layernorm_forward(dev, out, mean, rstd, inp, weight, bias) -> None:
    """out, inp: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,); weight, bias: (C,). Overwrites out, mean, rstd."""
    if not dev.kernels:
        return layernorm_forward_ref(out, mean, rstd, inp, weight, bias)
    C = inp.shape[-1]
    rows = inp.size // C
    args = (out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C), weight, bias)
    if dev.kind == "gpu":
        dev.launch(layernorm_forward_warp_kernel, *warp_rows_geometry(dev, rows), *args)
    else:
        dev.launch(layernorm_forward_kernel, rows, dev.block_size, *args)


def layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """Accumulates (+=) into dinp (B,T,C) or (N,C), dweight (C,), dbias (C,)."""
    if not dev.kernels:
        return layernorm_backward_ref(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    C = inp.shape[-1]
    rows = inp.size // C
    bs = dev.block_size
    dout2, inp2, mean1, rstd1 = dout.reshape(-1, C), inp.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    args = (dinp.reshape(-1, C), dout2, inp2, weight, mean1, rstd1)
    if dev.kind == "gpu":
        dev.launch(layernorm_backward_inp_warp_kernel, *warp_rows_geometry(dev, rows), *args)
    else:
        dev.launch(layernorm_backward_inp_kernel, rows, bs, *args)
    # dweight, dbias: partial sums over chunks of rows, then the chunks in order
    grid, block, R, chunk = colsum_geometry(dev, rows, C)
    part_w = dev.scratch("layernorm_dweight", (R, C), np.float64)
    part_b = dev.scratch("layernorm_dbias", (R, C), np.float64)
    dev.launch(layernorm_backward_params_partial_kernel, grid, block,
               part_w, part_b, dout2, inp2, mean1, rstd1, chunk)
    dev.launch(layernorm_backward_params_final_kernel, ceil_div(C, bs), bs, dweight, dbias, part_w, part_b)
