"""Column sums (matmul's bias gradient), version by version (llm.c's dev/cuda role): each version checked
against the float64 reference on fresh random bf16 inputs and timed at the bias gradients of d12..d48
(dout (B*T, OC), OC = 3C, C, 4C), a table last (dev/harness.py).

    python dev/column_sum.py [--model d48] [-b 8] [VERSION ...]

version 1: the teaching kernel (llmz.kernels.matmul.matmul_backward_bias_kernel): one thread per column over
           all N rows, float64
version 2: two stages in one launch, strips of 64 columns read as words of two (4-byte loads), chunks of 256
           rows, 8 loads in flight a thread, stage 2 in each strip's last block (the fast kernel until the
           units; a warp reads 128 bytes of a row: at d48 the partial-row reads ran at ~0.9 TB/s)
version 3: llmz.fast.column_sum: strips of 256 columns in units of 8 (16-byte loads, a warp 512 bytes of a
           row), at most 32 chunks of >= 64 rows, 4 rows in flight a thread
"""
import os
import sys

import numba
import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from llmz.device import ceil_div
from llmz.fast import column_sum as fast
from llmz.fast.column_sum import last_in_strip
from llmz.fast.device_helpers import bounded_jit, load_pair, pair_view
from llmz.kernels.bf16 import load, store_add
from llmz.kernels.matmul import matmul_backward_bias_kernel

# version 2's geometry: strips of 32 columns (64 as words of two), chunks of 256 rows, 8 lanes
COLSUM_STRIP = 32
COLSUM_PAIR_STRIP = 2 * COLSUM_STRIP
COLSUM_ROWS, COLSUM_LANES = 256, 8
MAX_LANES = 32
PAIRS_THREADS, PAIRS_BLOCKS_PER_SM = COLSUM_STRIP * COLSUM_LANES, 6
U1, U2, U3, U4, U5, U6, U7, U8 = (np.uint64(k) for k in range(1, 9))


def geometry(N: int, C: int, pairs: bool):
    """Version 2's launch: (grid, block, R, rows_per_block)."""
    R = max(1, ceil_div(N, COLSUM_ROWS))
    return (ceil_div(C, COLSUM_PAIR_STRIP if pairs else COLSUM_STRIP), R), (COLSUM_STRIP, COLSUM_LANES), R, COLSUM_ROWS


# ---- version 2's pieces and kernels (the layernorm dweight/dbias kernel of dev/layernorm.py uses them too) --
@cuda.jit(device=True)
def stage_rows(N, rows_per_block):
    """In a stage-1 block: (c, first, end, step), this thread's column and its rows range(first, end, step)
    of the block's chunk. The caller checks c < C."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row0 = cuda.blockIdx.y * rows_per_block
    return c, row0 + cuda.threadIdx.y, min(row0 + rows_per_block, N), cuda.blockDim.y


@cuda.jit(device=True)
def sum_rows(x, c, first, end, step):
    """The float64 sum of x[first:end:step, c] (x: (rows, C), any storage), added in row order. The loads go
    ROW_LOADS = 8 at a time, all eight issued before their adds: the order of the adds, and so the bits, are
    those of a plain loop over the rows. c must be a column of x: the kernels call it outside any branch (a
    column past the end sums column C-1 and drops the sum); inside an `if`, ptxas interleaves the adds with
    the loads."""
    acc = np.float64(0.0)
    row = first
    # eight rows at a time: the eight loads, independent, then the eight adds in row order
    while row + 7 * step < end:
        x0 = load(x, (row, c))
        x1 = load(x, (row + step, c))
        x2 = load(x, (row + 2 * step, c))
        x3 = load(x, (row + 3 * step, c))
        x4 = load(x, (row + 4 * step, c))
        x5 = load(x, (row + 5 * step, c))
        x6 = load(x, (row + 6 * step, c))
        x7 = load(x, (row + 7 * step, c))
        acc += x0
        acc += x1
        acc += x2
        acc += x3
        acc += x4
        acc += x5
        acc += x6
        acc += x7
        row += 8 * step
    # the last rows (fewer than eight), one at a time
    while row < end:
        acc += load(x, (row, c))
        row += step
    return acc


@cuda.jit(device=True)
def lanes_in_order(buf, acc):
    """Every thread of a (32 columns) x (lanes) block calls this with its float64 `acc`. Returns, in lane 0,
    the sum of its column's lanes in lane order (0 in the other lanes). buf: shared (MAX_LANES,
    COLSUM_STRIP) float64, free for reuse on return."""
    tx = cuda.threadIdx.x
    buf[cuda.threadIdx.y, tx] = acc
    cuda.syncthreads()
    # lane 0 adds the lanes in order
    s = np.float64(0.0)
    if cuda.threadIdx.y == 0:
        for lane in range(cuda.blockDim.y):
            s += buf[lane, tx]
    cuda.syncthreads()                  # everyone is done with buf before it is reused
    return s


@cuda.jit(device=True)
def strip_partial(buf, acc, partial, c):
    """Every thread of a stage-1 block calls this with `acc`, its float64 sum over its rows of column c
    (any value where c is out of range: not written). Overwrites partial[blockIdx.y, c] with the sum of the block's lanes, in
    lane order. buf: shared (MAX_LANES, COLSUM_STRIP) float64, free for reuse on return."""
    s = lanes_in_order(buf, acc)
    if cuda.threadIdx.y == 0 and c < partial.shape[1]:
        partial[cuda.blockIdx.y, c] = s


@cuda.jit(device=True)
def column_total(buf, partial, c):
    """Stage 2 in a (32 columns) x (lanes) block: returns, in lane 0, the float64 sum of partial[0:R, c], lane
    y adding rows y, y+lanes, ... in order, then the lanes in order (any value where c is out of range: the
    caller drops it; the whole block must call this). buf as in lanes_in_order."""
    R, C = partial.shape
    # this lane's partials (a column past the end sums column C-1, so every thread runs sum_rows unbranched)
    acc = sum_rows(partial, min(c, C - 1), cuda.threadIdx.y, R, cuda.blockDim.y)
    return lanes_in_order(buf, acc)


@cuda.jit(device=True)
def sum_rows_pair(x, w, first, end, step):
    """(s0, s1), the float64 sums of columns 2w and 2w+1 over rows range(first, end, step) of the words x
    (rows, C/2) (pair_view of float32 or bf16), each added in row order as sum_rows adds one column: the
    same bits. The word loads go ROW_LOADS = 8 at a time, all eight before their adds. w must be a word of x
    (called outside any branch, as sum_rows); first, end, step >= 0."""
    w = np.uint64(w)
    row = np.uint64(first)
    end = np.uint64(end)
    step = np.uint64(step)
    a0 = np.float64(0.0)
    a1 = np.float64(0.0)
    # eight rows at a time: the eight word loads, independent, then each column's eight adds in row order
    while row + U7 * step < end:
        u0, v0 = load_pair(x, (row, w))
        u1, v1 = load_pair(x, (row + step, w))
        u2, v2 = load_pair(x, (row + U2 * step, w))
        u3, v3 = load_pair(x, (row + U3 * step, w))
        u4, v4 = load_pair(x, (row + U4 * step, w))
        u5, v5 = load_pair(x, (row + U5 * step, w))
        u6, v6 = load_pair(x, (row + U6 * step, w))
        u7, v7 = load_pair(x, (row + U7 * step, w))
        a0 += u0
        a0 += u1
        a0 += u2
        a0 += u3
        a0 += u4
        a0 += u5
        a0 += u6
        a0 += u7
        a1 += v0
        a1 += v1
        a1 += v2
        a1 += v3
        a1 += v4
        a1 += v5
        a1 += v6
        a1 += v7
        row += U8 * step
    # the last rows (fewer than eight), one at a time
    while row < end:
        u, v = load_pair(x, (row, w))
        a0 += u
        a1 += v
        row += step
    return a0, a1


@cuda.jit(device=True)
def lanes_in_order_pair(buf, a0, a1):
    """lanes_in_order for a thread's two columns: returns, in lane 0, (s0, s1), each the sum of its column's
    lanes in lane order (0 in the other lanes). buf: shared (MAX_LANES, COLSUM_PAIR_STRIP) float64 (a0 at
    [lane, tx], a1 at [lane, 32 + tx]), free for reuse on return."""
    tx = cuda.threadIdx.x
    buf[cuda.threadIdx.y, tx] = a0
    buf[cuda.threadIdx.y, COLSUM_STRIP + tx] = a1
    cuda.syncthreads()
    # lane 0 adds the lanes in order, each column on its own
    s0 = np.float64(0.0)
    s1 = np.float64(0.0)
    if cuda.threadIdx.y == 0:
        for lane in range(cuda.blockDim.y):
            s0 += buf[lane, tx]
            s1 += buf[lane, COLSUM_STRIP + tx]
    cuda.syncthreads()                  # everyone is done with buf before it is reused
    return s0, s1


@cuda.jit(device=True)
def strip_partial_pair(buf, a0, a1, partial, c):
    """strip_partial for columns c and c+1 (c even, C even): overwrites partial[blockIdx.y, c] and [.., c+1]
    with the sums of the block's lanes, in lane order (not written where c >= C). buf as in
    lanes_in_order_pair."""
    s0, s1 = lanes_in_order_pair(buf, a0, a1)
    if cuda.threadIdx.y == 0 and c < partial.shape[1]:
        partial[cuda.blockIdx.y, c] = s0
        partial[cuda.blockIdx.y, c + 1] = s1


@cuda.jit(device=True)
def column_total_pair(buf, partial, c):
    """column_total for columns c and c+1 (c even, C even): returns, in lane 0, (s0, s1), each the float64 sum
    of its column's R partials in column_total's order (the same bits: two sum_rows). The whole block must call it."""
    R, C = partial.shape
    c = min(c, C - 2)
    a0 = sum_rows(partial, c, cuda.threadIdx.y, R, cuda.blockDim.y)
    a1 = sum_rows(partial, c + 1, cuda.threadIdx.y, R, cuda.blockDim.y)
    return lanes_in_order_pair(buf, a0, a1)


@cuda.jit
def column_sum_kernel(out, partial, counters, x, rows_per_block):
    """out: (C,); partial: (R,C) float64 scratch; counters: (ceil(C/32),) int32, zero (and left zero);
    x: (N,C). Grid (ceil(C/32), R), block (32, lanes). Overwrites partial[blockIdx.y, columns of this strip];
    the last block of each strip accumulates (+=) the strip's sums into out."""
    N, C = x.shape
    buf = cuda.shared.array((MAX_LANES, COLSUM_STRIP), numba.float64)
    flag = cuda.shared.array(1, numba.int32)
    c, first, end, step = stage_rows(N, rows_per_block)
    # stage 1: this thread's rows of the chunk, in order, in float64 (a column past the end sums column C-1,
    # so the whole warp goes through sum_rows; strip_partial drops it), then the block's lanes in order
    acc = sum_rows(x, min(c, C - 1), first, end, step)
    strip_partial(buf, acc, partial, c)
    # stage 2, in the strip's last block only: the column's partials, lane by lane in order; lane 0 writes out[c]
    if not last_in_strip(flag, counters):
        return
    s = column_total(buf, partial, c)
    if cuda.threadIdx.y == 0 and c < C:
        store_add(out, c, s)


@bounded_jit(PAIRS_THREADS, PAIRS_BLOCKS_PER_SM)
def column_sum_pairs_kernel(out, partial, counters, x, rows_per_block):
    """column_sum_kernel on words: x: (N, C/2) pair_view words of an (N,C) float32 or bf16 array, C even;
    out: (C,); partial: (R,C) float64 scratch; counters: (ceil(C/64),) int32, zero (and left zero). Grid
    (ceil(C/64), R), block (32, lanes): thread (tx, y) of block (x, y) takes word 32x + tx, columns 64x + 2tx
    and +1. Overwrites partial[blockIdx.y, columns of this strip]; the strip's last block accumulates (+=) the
    sums into out. Every column's adds are column_sum_kernel's: the same bits."""
    N, W = x.shape
    C = 2 * W
    buf = cuda.shared.array((MAX_LANES, COLSUM_PAIR_STRIP), numba.float64)
    flag = cuda.shared.array(1, numba.int32)
    w, first, end, step = stage_rows(N, rows_per_block)
    c = 2 * w
    # stage 1: this thread's rows of the chunk, both columns in order, in float64 (a word past the end sums
    # word W-1, dropped by strip_partial_pair), then the block's lanes in order
    a0, a1 = sum_rows_pair(x, min(w, W - 1), first, end, step)
    strip_partial_pair(buf, a0, a1, partial, c)
    # stage 2, in the strip's last block only: each column's partials, lane by lane in order
    if not last_in_strip(flag, counters):
        return
    s0, s1 = column_total_pair(buf, partial, c)
    if cuda.threadIdx.y == 0 and c < C:
        store_add(out, c, s0)
        store_add(out, c + 1, s1)



# ---- the versions -------------------------------------------------------------------------------------
def v1(dev, d, case=None):
    OC = d["x"].shape[1]
    dev.launch(matmul_backward_bias_kernel, ceil_div(OC, 256), 256, d["out"], d["x"])


def v2(dev, d, case=None):
    x = d["x"]
    N, OC = x.shape
    grid, block, R, rows = geometry(N, OC, True)
    partial = dev.scratch("dev_colsum", (R, OC), np.float64)
    counters = dev.scratch("dev_colsum_count", grid[0], np.int32)
    dev.launch(column_sum_pairs_kernel, grid, block, d["out"], partial, counters, pair_view(x), rows)


def v3(dev, d, case=None):
    fast.column_sum(dev, d["out"], d["x"])


VERSIONS = {1: ("teaching: a thread per column", v1), 2: ("words of two, 64-column strips", v2),
            3: ("units of 8, 256-column strips", v3)}


def cases(cfg, B):
    C, N = cfg.channels, B * harness.T
    for label, OC in (("qkv bias 3C", 3 * C), ("attproj bias C", C), ("fc bias 4C", 4 * C)):
        def make(OC=OC):
            return {"x": harness.rand((N, OC)), "out": harness.rand(OC)}

        def reference(d):
            return {"out": harness.f64(d["out"]) + harness.f64(d["x"]).sum(axis=0)}
        yield label, make, (), reference, N * OC * 2 + 4 * OC, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("column_sum", __doc__, VERSIONS, cases, sys.argv[1:]))
