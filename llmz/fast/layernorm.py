"""LayerNorm's fast kernels (llm.c's llmc/layernorm.cuh role). The math, shapes and dtypes are those of
llmz/kernels/layernorm.py; each kernel here replaces a teaching kernel there:

  forward, warp      replaces layernorm_forward_kernel (one block per row, three strided passes, float64
                     arithmetic per element): one WARP per row, 4 rows per block, the row held in registers
                     (lane l holds channels l, l+32, ..., at most MAX_PER_LANE = 32 of them: C <= 1024), every
                     load issued before any arithmetic; each lane sums its values in the compute dtype, the 32
                     lanes add in float64 (warp_sum's butterfly)
  backward, warp     replaces layernorm_backward_inp_kernel the same way: inp, dout and dinp (accumulated) in
                     registers
  warp loop          C > 1024 (d36, d48): a warp per row, strided passes over the row, float64 sums
  backward, params   replaces layernorm_backward_params_kernel (one thread per channel over all rows): the two
                     stages of llmz.fast.column_sum in one launch, each stage-1 thread loading ROWS_IN_FLIGHT =
                     8 rows (inp, dout, mean, rstd) before adding them (the batch in the compute dtype, the
                     batches in float64)
Contract: not the teaching kernels' bits (the sums group differently): out, mean, rstd, dinp within 1e-6
relative (normwise) of the float64 reference in float32, as the teaching kernels are; dweight, dbias: a
float64 sum in another order, a few float32 ulps. Every sum is in a fixed order: the same bits every run.
"""
import math

import numba
import numpy as np
from numba import cuda, types
from numba.cuda.extending import overload

from ..kernels.bf16 import load, store, store_add
from ..kernels.grid import ceil_div
from ..kernels.layernorm import LN_EPS
from .column_sum import (
    COLSUM_STRIP,
    MAX_LANES,
    colsum_geometry,
    column_total,
    last_in_strip,
    stage_rows,
    strip_partial,
)
from .device_helpers import WARP, warp_row, warp_sum

# the register kernels: channels per lane (C <= 32 * 32 = 1024: d12, d24), warps (rows) per block
MAX_PER_LANE = 32
WARPS_PER_BLOCK = 4
# rows a stage-1 thread of the dweight/dbias kernel loads before adding them
ROWS_IN_FLIGHT = 8


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


@cuda.jit(device=True)
def lane_shares(x, g, dx, x_row, g_row, dx_row, lane, C):
    """x[k], g[k], dx[k] = the rows' channel lane + 32k, for the channels < C (the other slots untouched):
    lane `lane`'s share of three rows of C. Unrolled (k up to MAX_PER_LANE), so every load is issued before
    any arithmetic reads them."""
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            x[k] = x_row[i]
            g[k] = g_row[i]
            dx[k] = dx_row[i]


@cuda.jit
def layernorm_backward_inp_warp_kernel(dinp, dout, inp, weight, mean, rstd):
    """dinp, dout, inp: (N,C), C <= 32 * MAX_PER_LANE; weight: (C,); mean, rstd: (N,). One warp per row, the
    rows of inp, dout and dinp in registers as in the forward. Accumulates (+=) into dinp."""
    N, C = inp.shape
    row, lane = warp_row()
    if row >= N:
        return
    # read the three rows once, every load issued before any arithmetic
    x = cuda.local.array(MAX_PER_LANE, inp.dtype)
    g = cuda.local.array(MAX_PER_LANE, dout.dtype)
    dx = cuda.local.array(MAX_PER_LANE, dinp.dtype)
    lane_shares(x, g, dx, inp[row], dout[row], dinp[row], lane, C)
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
    dx_row = dinp[row]
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
    m, s = mean[row], rstd[row]          # the row's statistics, from the forward
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


# ---- the layer ---------------------------------------------------------------------------------
def layernorm_forward(dev, out, mean, rstd, inp, weight, bias) -> None:
    """out, inp: (B,T,C) or (N,C); mean, rstd: (B,T) or (N,); weight, bias: (C,). Overwrites out, mean, rstd."""
    C = inp.shape[-1]
    dev.launch(warp_kernels(C)[0], *warp_rows_geometry(inp.size // C),
               out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C), weight, bias)


def layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """Accumulates (+=) into dinp (B,T,C) or (N,C), dweight (C,), dbias (C,)."""
    C = inp.shape[-1]
    rows = inp.size // C
    dout2, inp2, mean1, rstd1 = dout.reshape(-1, C), inp.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
    dev.launch(warp_kernels(C)[1], *warp_rows_geometry(rows), dinp.reshape(-1, C), dout2, inp2, weight, mean1, rstd1)
    # dweight, dbias: partial sums over chunks of rows, then (each strip's last block) the chunks in order
    grid, block, R, chunk = colsum_geometry(dev, rows, C)
    part_w = dev.scratch("layernorm_dweight", (R, C), np.float64)
    part_b = dev.scratch("layernorm_dbias", (R, C), np.float64)
    counters = dev.scratch("layernorm_params_count", grid[0], np.int32)
    dev.launch(layernorm_backward_params_kernel, grid, block,
               dweight, dbias, part_w, part_b, counters, dout2, inp2, mean1, rstd1, chunk)
