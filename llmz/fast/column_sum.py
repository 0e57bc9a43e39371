"""The one-launch column sums: out (C,) += x (N,C) summed over the N rows, deterministic and parallel. They
replace llmz/kernels/matmul.py's matmul_backward_bias_kernel (one thread per column looping over all N rows:
only C threads, each N dependent adds) as matmul's bias gradient; layernorm's dweight/dbias (llmz.fast.layernorm)
is built from the same pieces. Contract: the same float64 sum in another fixed order, rounded once into out:
within one rounding of the teaching kernel's result (float32: an ulp; bf16: a bf16 step).

  stage 1  grid (ceil(C/32), R): block (x, y) takes a strip of COLSUM_STRIP = 32 columns and a chunk of
           rows_per_block rows, R = ceil(N / rows_per_block); threads (32 columns) x (lanes): threadIdx.x is the
           column (a warp reads 32 consecutive elements of a row), lane y takes rows y, y+lanes, ... of the
           chunk, ROW_LOADS = 8 loads in flight (sum_rows). Each thread sums in float64, the lanes are added
           in lane order and the block writes partial[y, 32x:32x+32] (float64 (R, C) scratch).
  stage 2  in the block that finishes its strip last (last_in_strip: each block counts itself on an int32
           counter per strip; the one that counts R reads the strip's partials and resets the counter, CUDA's
           threadFenceReduction sample): lane y sums partial rows y, y+lanes, ... in order, the lanes in lane
           order, and the sum goes into out[c]. Which block that is changes from run to run; what it adds, and
           in which order, does not (the order depends only on N, C, rows_per_block and lanes).
Paired (float32 and bf16 x, C even, contiguous and word-aligned: pairs_fit): column_sum_pairs_kernel reads x
as llmz.fast.device_helpers' words of two neighbouring columns, strips of 64 columns, each column added as
column_sum_kernel adds it: the same bits as column_sum_kernel. x and out may be float32, float64 or uint16
(bf16 bits, through llmz.kernels.bf16's load / store_add); the partial sums are float64.
"""
import numba
import numpy as np
from numba import cuda

from ..kernels.bf16 import load, store_add
from ..kernels.grid import ceil_div
from .device_helpers import address, bounded_jit, load_pair, pair_view

# columns per stage-1 block: one warp reads 32 consecutive columns of a row
COLSUM_STRIP = 32
# columns per stage-1 block of the paired kernels: one warp reads 32 words, 64 consecutive columns, of a row
COLSUM_PAIR_STRIP = 2 * COLSUM_STRIP
# rows per stage-1 block and lanes (threadIdx.y) per block: on the GPU 256 rows, 32 x 8 = 256 threads; the
# simulator runs each thread as a Python thread, so there: chunks of 8 rows, 32 x 4 threads.
# The numbers, for the bias gradients (N = B*T = 16384 rows, C = 768, 2304 or 3072) on the H200 (132 SMs,
# 2048 threads = 8 such blocks each, 1056 blocks resident at once):
#   stage 1  R = 16384/256 = 64 chunks: 1536, 4608, 6144 blocks (1.5 to 6 waves of 1056); each thread sums
#            256/8 = 32 rows, 4 trips of 8 loads in flight
#   stage 2  64 partials per column over 8 lanes: 8 per lane, one trip of 8 loads, then 8 lane adds, in 24,
#            72 or 96 blocks (the last of each strip); the partials (64 x C float64: 0.4 to 1.6 MB, in L2)
#            cost 3% of stage 1's bf16 reads
# Fewer rows per block would mean more partials (stage 2 and the scratch grow); more rows per block, fewer
# blocks than 2 waves at C=768. layernorm's parameter gradients use the same geometry.
COLSUM_ROWS, COLSUM_LANES = 256, 8
COLSUM_ROWS_SIM, COLSUM_LANES_SIM = 8, 4
# the most lanes the shared buffer of strip_partial holds (32 x 32 = 1024 threads)
MAX_LANES = 32
# the paired kernels' launch bounds on the GPU: blocks of at most 32 x COLSUM_LANES = 256 threads, PAIRS_BLOCKS_PER_SM
# resident per SM. Without them ptxas (sm_90) fits column_sum_pairs_kernel in 32 registers (8 blocks an SM) by
# interleaving the loads of sum_rows_pair with their adds (4 loads issued, then one per add); with 6 blocks
# an SM it takes 40 and issues all eight loads first. (At C=768 the paired grid is 12 x 64 = 768 blocks, under
# 6 per SM anyway.)
PAIRS_THREADS, PAIRS_BLOCKS_PER_SM = COLSUM_STRIP * COLSUM_LANES, 6


# the loads a thread issues together in sum_rows (written out as x0..x7 there): 8 bf16 loads of 2 bytes per
# thread, 2048 threads per SM, 32 KB in flight per SM (about 4 TB/s at ~1 us loaded latency, 132 SMs)
ROW_LOADS = 8


# ---- the pieces a two-stage kernel is built from ----------------------------------------------------
def colsum_geometry(dev, N: int, C: int, rows_per_block: int | None = None, pairs: bool = False):
    """The launch for N rows and C columns: (grid, block, R, rows_per_block); the partial-sum scratch is
    (R, C) float64, the counters (grid[0],) int32. R >= 1, so N = 0 gives one block of zero sums. pairs: the
    paired kernels' launch, strips of COLSUM_PAIR_STRIP = 64 columns (32 words), the same block, R and rows."""
    sim = dev.kind == "sim"
    rows = rows_per_block or (COLSUM_ROWS_SIM if sim else COLSUM_ROWS)
    lanes = COLSUM_LANES_SIM if sim else COLSUM_LANES
    R = max(1, ceil_div(N, rows))
    strip = COLSUM_PAIR_STRIP if pairs else COLSUM_STRIP
    return (ceil_div(C, strip), R), (COLSUM_STRIP, lanes), R, rows


def pairs_fit(*xs) -> bool:
    """The paired kernels apply to these (rows, C) arrays: each float32 or bf16 (uint16), C even, C-contiguous,
    starting on a word boundary (so every row does: C is even)."""
    return all(
        x.ndim == 2 and x.shape[1] % 2 == 0 and x.shape[1] > 0 and x.dtype in (np.float32, np.uint16)
        and x.flags.c_contiguous and address(x) % (2 * x.itemsize) == 0 for x in xs)


@cuda.jit(device=True)
def stage_rows(N, rows_per_block):
    """In a stage-1 block: (c, first, end, step), this thread's column and its rows range(first, end, step)
    of the block's chunk. The caller checks c < C."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row0 = cuda.blockIdx.y * rows_per_block
    return c, row0 + cuda.threadIdx.y, min(row0 + rows_per_block, N), cuda.blockDim.y


@cuda.jit(device=True, inline="always")
def add_in_order(acc, x0, x1, x2, x3, x4, x5, x6, x7):
    """acc + x0 + x1 + ... + x7, added one at a time in that order (float64). Inlined by Numba
    (inline="always"): the kernels compile to the PTX of the adds written out in place."""
    acc += x0
    acc += x1
    acc += x2
    acc += x3
    acc += x4
    acc += x5
    acc += x6
    acc += x7
    return acc


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
        acc = add_in_order(acc, x0, x1, x2, x3, x4, x5, x6, x7)
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
def last_in_strip(flag, counters):
    """Every thread of a stage-1 block calls this right after strip_partial (its lane-0 threads wrote the
    block's partial sums). Counts the block on counters[blockIdx.x] (int32, 0 before the strip's first block
    counts) and returns, in every thread, whether this block is the strip's last of gridDim.y to count; that
    block resets the counter to 0 (the next launch, or the next replay of a CUDA graph, starts from 0), and
    its threads then see every block's partial sums of the strip. flag: shared (1,) int32."""
    # release: the writers fence their partial sums before the block is counted (fence, barrier, count)
    if cuda.threadIdx.y == 0:
        cuda.threadfence()
    cuda.syncthreads()
    # one thread counts the block; the strip's R-th count is its last block
    if cuda.threadIdx.x == 0 and cuda.threadIdx.y == 0:
        last = cuda.atomic.add(counters, cuda.blockIdx.x, 1) == cuda.gridDim.y - 1
        if last:
            counters[cuda.blockIdx.x] = 0
            # acquire: this fence, after the count that saw the other blocks' counts and before the barrier
            # that passes the answer on, makes the block's reads see the partials those blocks wrote before
            # their fence and count (in hardware it also drops stale L1 lines: a last block of the
            # neighbouring strip that ran on this SM may have read a 128-byte line this strip shares, when
            # C is not a multiple of 16)
            cuda.threadfence()
        flag[0] = 1 if last else 0
    cuda.syncthreads()
    return flag[0] != 0


@cuda.jit(device=True)
def column_total(buf, partial, c):
    """Stage 2 in a (32 columns) x (lanes) block: returns, in lane 0, the float64 sum of partial[0:R, c], lane
    y adding rows y, y+lanes, ... in order, then the lanes in order (any value where c is out of range: the
    caller drops it; the whole block must call this). buf as in lanes_in_order."""
    R, C = partial.shape
    # this lane's partials (a column past the end sums column C-1, so every thread runs sum_rows unbranched)
    acc = sum_rows(partial, min(c, C - 1), cuda.threadIdx.y, R, cuda.blockDim.y)
    return lanes_in_order(buf, acc)


# ---- the paired pieces: a thread takes word w, columns 2w and 2w+1 ------------------------------------
# The paired row loops index with unsigned integers: with signed ones Numba adds a negative-index test to
# every index and ptxas (sm_90) then interleaves each load with its add, one or two loads in flight a thread
# (column_sum_kernel's sum_rows compiles that way); unsigned, the eight loads go out together.
U1, U2, U3, U4, U5, U6, U7, U8 = (np.uint64(k) for k in range(1, 9))


@cuda.jit(device=True, inline="always")
def unsigned_rows(first, end, step):
    """The row loop's (first, end, step) as unsigned integers (the note above)."""
    return np.uint64(first), np.uint64(end), np.uint64(step)


@cuda.jit(device=True)
def sum_rows_pair(x, w, first, end, step):
    """(s0, s1), the float64 sums of columns 2w and 2w+1 over rows range(first, end, step) of the words x
    (rows, C/2) (pair_view of float32 or bf16), each added in row order as sum_rows adds one column: the
    same bits. The word loads go ROW_LOADS = 8 at a time, all eight before their adds. w must be a word of x
    (called outside any branch, as sum_rows); first, end, step >= 0."""
    w = np.uint64(w)
    row, end, step = unsigned_rows(first, end, step)
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
        a0 = add_in_order(a0, u0, u1, u2, u3, u4, u5, u6, u7)
        a1 = add_in_order(a1, v0, v1, v2, v3, v4, v5, v6, v7)
        row += U8 * step
    # the last rows (fewer than eight), one at a time
    while row < end:
        u, v = load_pair(x, (row, w))
        a0 += u
        a1 += v
        row += step
    return a0, a1


@cuda.jit(device=True)
def sum_rows_two(x, c0, c1, first, end, step):
    """(s0, s1): sum_rows of columns c0 and c1 of x (any storage) over the same rows, both in row order (the
    same bits as two sum_rows calls), the 16 loads of eight rows issued before their adds (unsigned indices,
    as sum_rows_pair)."""
    c0 = np.uint64(c0)
    c1 = np.uint64(c1)
    row, end, step = unsigned_rows(first, end, step)
    a0 = np.float64(0.0)
    a1 = np.float64(0.0)
    while row + U7 * step < end:
        r1, r2, r3, r4 = row + step, row + U2 * step, row + U3 * step, row + U4 * step
        r5, r6, r7 = row + U5 * step, row + U6 * step, row + U7 * step
        u0, v0 = load(x, (row, c0)), load(x, (row, c1))
        u1, v1 = load(x, (r1, c0)), load(x, (r1, c1))
        u2, v2 = load(x, (r2, c0)), load(x, (r2, c1))
        u3, v3 = load(x, (r3, c0)), load(x, (r3, c1))
        u4, v4 = load(x, (r4, c0)), load(x, (r4, c1))
        u5, v5 = load(x, (r5, c0)), load(x, (r5, c1))
        u6, v6 = load(x, (r6, c0)), load(x, (r6, c1))
        u7, v7 = load(x, (r7, c0)), load(x, (r7, c1))
        a0 = add_in_order(a0, u0, u1, u2, u3, u4, u5, u6, u7)
        a1 = add_in_order(a1, v0, v1, v2, v3, v4, v5, v6, v7)
        row += U8 * step
    while row < end:
        a0 += load(x, (row, c0))
        a1 += load(x, (row, c1))
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
    of its column's R partials in column_total's order (the same bits). The whole block must call it."""
    R, C = partial.shape
    c = min(c, C - 2)
    a0, a1 = sum_rows_two(partial, c, c + 1, cuda.threadIdx.y, R, cuda.blockDim.y)
    return lanes_in_order_pair(buf, a0, a1)


# ---- Numba kernels ------------------------------------------------------------------------------
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


# ---- the layer ---------------------------------------------------------------------------------
def column_sum(dev, out, x, rows_per_block: int | None = None) -> None:
    """out: (C,); x: (..., C). Accumulates (+=) the column sums of x into out. Uses dev.scratch("colsum", (R, C),
    float64) for the partial sums and dev.scratch("colsum_count", (strips,), int32) for the blocks counted per
    strip (zero between launches): ceil(C/32) strips, or ceil(C/64) where the paired kernel runs (pairs_fit)."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    pairs = pairs_fit(x2)
    grid, block, R, rows = colsum_geometry(dev, x2.shape[0], C, rows_per_block, pairs)
    partial = dev.scratch("colsum", (R, C), np.float64)
    counters = dev.scratch("colsum_count", grid[0], np.int32)
    dev.launch(column_sum_pairs_kernel if pairs else column_sum_kernel, grid, block, out, partial, counters,
               pair_view(x2) if pairs else x2, rows)
