"""LayerNorm over the last axis (channels), as llm.c's train_gpt2.c computes it (eps = 1e-5, biased variance):

    mean = (1/C) sum_i x_i,   rstd = 1 / sqrt((1/C) sum_i (x_i - mean)^2 + eps)
    norm_i = (x_i - mean) * rstd,   out_i = norm_i * w_i + b_i
    backward, with dnorm_i = w_i * dout_i:
    dx_i = rstd * (dnorm_i - mean_j(dnorm_j) - norm_i * mean_j(dnorm_j * norm_j))
    dw_i = sum over rows of norm_i * dout_i,   db_i = sum over rows of dout_i

Kernels (the teaching versions):
  forward          one block per row; threads stride over C; two shared-memory reductions (mean, then variance)
  backward, rows   one block per row; two shared-memory reductions (the two means above), then dinp += ...
  backward, params two stages in one launch (reduce.py's column-sum pattern): stage 1, grid (ceil(C/32),
                   ceil(N/256)), each block sums norm*dout and dout over a chunk of rows for a strip of 32
                   channels into two float64 (R,C) scratch buffers; stage 2, in the last block of each strip to
                   finish (reduce.last_in_strip), over the strip's R partials, each lane adding its partials in
                   order, then the lanes in order (reduce.column_total).
                   Stage 1's threads load ROWS_IN_FLIGHT = 8 rows (inp, dout, mean, rstd) before adding them
                   (the batch in the compute dtype, the batches in float64); before, one load then one add per
                   row waited a memory latency per row, and stage 2 was one thread per channel over all R
                   partials (d12 bf16, 25 calls a step: stage 1 2.18 ms, stage 2 1.28 ms); then stage 2 in a
                   second launch of (32 x 8)-thread blocks, 0.82 ms in 25 calls (33 us each). After, one
                   launch: 1.15 ms in 25 calls, against 1.73 + 0.82 before.
                   A paired variant (dout and inp read as words of two channels, the same bits) ran no
                   faster on the H200 (bf16 d12: 1.26 ms against 1.15; 0.282 against 0.289 ms a call at
                   N=16384): this kernel already issues 32 loads a batch. Not kept.
Fast versions, GPU only (the simulator has no warp shuffles; it runs the teaching versions above):
  forward, warp    one WARP per row, 4 rows per block, the row held in registers: lane l loads channels l, l+32,
                   ... (at most MAX_PER_LANE = 32 of them: C <= 1024) into a local array the compiler keeps in
                   registers, every load issued before any arithmetic (one memory latency per row); the mean,
                   the variance (two passes, exact) and the write then read the registers. Each lane sums its
                   <= 32 values in the compute dtype, the 32 lanes add in float64 (a butterfly of shuffles):
                   float64 per element would cost a float32->float64 conversion per element and sum, and the
                   H200 converts at 1/8 of its float32 rate; a NumPy model of these sums at d12's size keeps
                   out, mean, rstd and dinp within 6e-8 of float64 (relative), as the float64 sums did.
                   Replaces the loop kernel below: three strided passes with one load (and one memory latency)
                   per iteration and float64 arithmetic per element (25 calls a d12 bf16 step: 4.52 ms,
                   279 GB/s; after: 1.18 ms, 1.07 TB/s).
  backward, warp   the rows part the same way: inp, dout and dinp (accumulated) held in registers (before:
                   3.36 ms, 563 GB/s; after: 1.16-1.47 ms, 1.3-1.6 TB/s).
  forward/backward, warp loop   C > 1024 (d36, d48): the first warp kernels, three (two) strided passes over
                   the row, the re-reads from L1, float64 sums. They replaced one 256-thread block per row, 3
                   channels a thread at C=768 (d12 fp32, 25 calls: forward 5.07 ms, backward 4.55 ms).
Sums are deterministic: the block's threads are summed in a fixed order (norm.block_sum's tree,
reduce.strip_partial's lanes, warp_sum's butterfly), each thread's values in index order.

inp, out, dinp, dout, weight, bias, dweight, dbias are float32, float64 or uint16 (bf16 bits, computed in
float32, results rounded to nearest), each on its own: the kernels read and write them through
llmz.kernels.bf16's load / store / store_add. mean and rstd are statistics: they keep the dtype they are given
(float32 beside bf16 activations), read and written directly, as are the float64 partial sums. The compute
dtype (as_compute) is float32 beside float32 and bf16 arrays, float64 beside float64 ones.
"""
import math

import numba
import numpy as np
from numba import cuda, types
from numba.cuda.extending import overload

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, store, store_add
from .norm import MAX_BLOCK, block_sum
from .reduce import (
    COLSUM_STRIP,
    MAX_LANES,
    colsum_geometry,
    column_total,
    last_in_strip,
    stage_rows,
    strip_partial,
)

LN_EPS = 1e-5
WARP = 32                   # threads per warp: the fast kernels give each row one warp
FULL_MASK = 0xFFFFFFFF      # every lane of the warp takes part in the shuffle
# the register kernels: channels per lane (C <= 32 * 32 = 1024: d12, d24), warps (rows) per block
MAX_PER_LANE = 32
WARPS_PER_BLOCK = 4
# rows a stage-1 thread of the dweight/dbias kernel loads before adding them (reduce.sum_rows, which stage 2
# uses, loads 8 at a time too)
ROWS_IN_FLIGHT = 8


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
def as_compute(a, v):
    """v as the float type the kernels compute in beside array a: float64 for float64 arrays, float32 for
    float32 and bf16 (uint16) ones. Picked per dtype like llmz.kernels.bf16's load (compile time on the GPU)."""
    return np.float64(v) if a.dtype == np.float64 else np.float32(v)


@overload(as_compute, target="cuda")
def _as_compute_cuda(a, v):
    if a.dtype == types.float64:
        return lambda a, v: np.float64(v)
    return lambda a, v: np.float32(v)


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
def layernorm_backward_params_kernel(dweight, dbias, part_w, part_b, counters, dout, inp, mean, rstd,
                                     rows_per_block):
    """dweight, dbias: (C,); part_w, part_b: (R,C) float64 scratch; counters: (ceil(C/32),) int32, zero (and
    left zero); dout, inp: (N,C); mean, rstd: (N,). Grid (ceil(C/32), R), block (32, lanes): block (x, y) sums
    rows [y*rows_per_block, (y+1)*rows_per_block) of channels [32x, 32x+32) and overwrites part_w[y], part_b[y]
    there; the last block of strip x to finish adds the strip's R partials, lane y partial rows y, y+lanes,
    ... in order, then the lanes in order. Accumulates (+=) into dweight, dbias."""
    N, C = inp.shape
    buf = cuda.shared.array((MAX_LANES, COLSUM_STRIP), numba.float64)
    flag = cuda.shared.array(1, numba.int32)
    x = cuda.local.array(ROWS_IN_FLIGHT, inp.dtype)
    g = cuda.local.array(ROWS_IN_FLIGHT, dout.dtype)
    m = cuda.local.array(ROWS_IN_FLIGHT, mean.dtype)
    s = cuda.local.array(ROWS_IN_FLIGHT, rstd.dtype)
    c, first, end, step = stage_rows(N, rows_per_block)
    acc_w = np.float64(0.0)
    acc_b = np.float64(0.0)
    if c < C:
        for row0 in range(first, end, step * ROWS_IN_FLIGHT):
            # this thread's next ROWS_IN_FLIGHT rows: every load before any add
            for u in range(ROWS_IN_FLIGHT):
                row = row0 + u * step
                if row < end:
                    x[u] = inp[row, c]
                    g[u] = dout[row, c]
                    m[u] = mean[row]
                    s[u] = rstd[row]
            # dweight: sum of norm * dout; dbias: sum of dout (the batch in the compute dtype, then float64)
            bw = as_compute(inp, 0)
            bb = as_compute(inp, 0)
            for u in range(ROWS_IN_FLIGHT):
                if row0 + u * step < end:
                    gu = load(g, u)
                    bw += (load(x, u) - m[u]) * s[u] * gu
                    bb += gu
            acc_w += bw
            acc_b += bb
    # the block's lanes, in order
    strip_partial(buf, acc_w, part_w, c)
    strip_partial(buf, acc_b, part_b, c)
    # stage 2, in the strip's last block only: both channels' partials, lane by lane in order; lane 0 adds
    # them into dweight[c], dbias[c]
    if not last_in_strip(flag, counters):
        return
    s_w = column_total(buf, part_w, c)
    s_b = column_total(buf, part_b, c)
    if cuda.threadIdx.y == 0 and c < C:
        store_add(dweight, c, s_w)
        store_add(dbias, c, s_b)


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
    row leave as a whole warp, so no shuffle ever misses a lane. The lane is tid & 31 (= tid % 32): the
    compiler then knows it is never negative and drops the negative-index test from every row[lane + 32k]."""
    tid = cuda.threadIdx.x
    return cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP, tid & (WARP - 1)


@cuda.jit
def layernorm_forward_warp_kernel(out, mean, rstd, inp, weight, bias):
    """inp, out: (N,C), C <= 32 * MAX_PER_LANE; mean, rstd: (N,); weight, bias: (C,). One warp per row, the
    row in registers: lane l holds channels l + 32k in x[k]. Overwrites out, mean, rstd."""
    N, C = inp.shape
    row, lane = warp_row()
    if row >= N:
        return
    x_row = inp[row]
    out_row = out[row]
    # read the row once, every load issued before any arithmetic (the slots past C hold 0)
    x = cuda.local.array(MAX_PER_LANE, inp.dtype)
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            x[k] = x_row[i]
        else:
            x[k] = 0
    # the mean over channels: the lane's sum, then the warp's float64 butterfly
    acc = as_compute(inp, 0)
    for k in range(MAX_PER_LANE):
        acc += load(x, k)
    m = warp_sum(np.float64(acc)) / C
    mc = as_compute(inp, m)
    # the biased variance, a second pass over the registers
    acc = as_compute(inp, 0)
    for k in range(MAX_PER_LANE):
        if lane + k * WARP < C:
            d = load(x, k) - mc
            acc += d * d
    s = 1.0 / math.sqrt(warp_sum(np.float64(acc)) / C + LN_EPS)
    sc = as_compute(inp, s)
    # normalize, then scale and shift
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            store(out_row, i, (load(x, k) - mc) * sc * load(weight, i) + load(bias, i))
    # cache for backward
    if lane == 0:
        mean[row] = m
        rstd[row] = s


@cuda.jit
def layernorm_backward_inp_warp_kernel(dinp, dout, inp, weight, mean, rstd):
    """dinp, dout, inp: (N,C), C <= 32 * MAX_PER_LANE; weight: (C,); mean, rstd: (N,). One warp per row, the
    rows of inp, dout and dinp in registers as in the forward. Accumulates (+=) into dinp."""
    N, C = inp.shape
    row, lane = warp_row()
    if row >= N:
        return
    x_row = inp[row]
    g_row = dout[row]
    dx_row = dinp[row]
    # read the three rows once, every load issued before any arithmetic
    x = cuda.local.array(MAX_PER_LANE, inp.dtype)
    g = cuda.local.array(MAX_PER_LANE, dout.dtype)
    dx = cuda.local.array(MAX_PER_LANE, dinp.dtype)
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            x[k] = x_row[i]
            g[k] = g_row[i]
            dx[k] = dx_row[i]
    m = as_compute(inp, mean[row])
    s = as_compute(inp, rstd[row])
    # the two means over the row, of dnorm = weight * dout and of dnorm * norm: lane sums, two butterflies
    acc_d = as_compute(inp, 0)
    acc_dn = as_compute(inp, 0)
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            norm = (load(x, k) - m) * s
            dnorm = load(weight, i) * load(g, k)
            acc_d += dnorm
            acc_dn += dnorm * norm
    dnorm_mean = as_compute(inp, warp_sum(np.float64(acc_d)) / C)
    dnorm_norm_mean = as_compute(inp, warp_sum(np.float64(acc_dn)) / C)
    # the input gradient, added to dinp's registers (store_add's arithmetic)
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            norm = (load(x, k) - m) * s
            dnorm = load(weight, i) * load(g, k)
            store(dx_row, i, load(dx, k) + s * (dnorm - dnorm_mean - norm * dnorm_norm_mean))


@cuda.jit
def layernorm_forward_warp_loop_kernel(out, mean, rstd, inp, weight, bias):
    """As layernorm_forward_warp_kernel for any C (the layer uses it for C > 32 * MAX_PER_LANE): three strided
    passes over the row (the second and third from L1), float64 sums. Overwrites out, mean, rstd."""
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
def layernorm_backward_inp_warp_loop_kernel(dinp, dout, inp, weight, mean, rstd):
    """As layernorm_backward_inp_warp_kernel for any C: two strided passes, float64 sums. Accumulates (+=)
    into dinp."""
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


def warp_rows_geometry(rows: int) -> tuple[int, int]:
    """(grid, block) of the warp-per-row kernels: WARPS_PER_BLOCK rows per block. Small blocks, because the
    register kernels use 80-170 registers a thread (ptxas, sm_90): the SM's 64K registers hold more warps in
    4-warp blocks than in 8-warp ones (float32 forward, ~88 registers: 20 warps against 16)."""
    return ceil_div(rows, WARPS_PER_BLOCK), WARPS_PER_BLOCK * WARP


def warp_kernels(C: int):
    """(forward, backward rows) warp kernels for C channels: the register kernels up to 32 * MAX_PER_LANE."""
    if C <= WARP * MAX_PER_LANE:
        return layernorm_forward_warp_kernel, layernorm_backward_inp_warp_kernel
    return layernorm_forward_warp_loop_kernel, layernorm_backward_inp_warp_loop_kernel


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def layernorm_forward(dev, out, mean, rstd, inp, weight, bias) -> None:
    """out, inp: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,); weight, bias: (C,). Overwrites out, mean, rstd."""
    if not dev.kernels:
        return layernorm_forward_ref(out, mean, rstd, inp, weight, bias)
    C = inp.shape[-1]
    rows = inp.size // C
    args = (out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C), weight, bias)
    if dev.kind == "gpu":
        dev.launch(warp_kernels(C)[0], *warp_rows_geometry(rows), *args)
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
        dev.launch(warp_kernels(C)[1], *warp_rows_geometry(rows), *args)
    else:
        dev.launch(layernorm_backward_inp_kernel, rows, bs, *args)
    # dweight, dbias: partial sums over chunks of rows, then (each strip's last block) the chunks in order
    grid, block, R, chunk = colsum_geometry(dev, rows, C)
    part_w = dev.scratch("layernorm_dweight", (R, C), np.float64)
    part_b = dev.scratch("layernorm_dbias", (R, C), np.float64)
    counters = dev.scratch("layernorm_params_count", grid[0], np.int32)
    dev.launch(layernorm_backward_params_kernel, grid, block,
               dweight, dbias, part_w, part_b, counters, dout2, inp2, mean1, rstd1, chunk)
