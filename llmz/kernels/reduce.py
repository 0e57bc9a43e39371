"""Column sums over many rows, deterministic and parallel: out (C,) (+)= x (N,C) summed over the N rows.

One thread per column looping over all N rows (the teaching version, see matmul_dbias_kernel) is
deterministic but latency-bound: only C threads, each N dependent adds. The two-stage version here:
  stage 1  grid (ceil(C/32), R): block (x, y) takes a strip of COLSUM_STRIP = 32 columns and a chunk of
           rows_per_block rows, R = ceil(N / rows_per_block). Its threads are (32 columns) x (lanes):
           threadIdx.x is the column, so a warp reads 32 consecutive floats of one row (coalesced);
           lane threadIdx.y takes rows y, y+lanes, ... of the chunk. Each thread sums in float64, the
           lanes are added in lane order in shared memory and the block writes partial[y, 32x:32x+32],
           a float64 (R, C) scratch buffer.
  stage 2  one thread per column sums partial[0:R, c] in order and adds it into (or writes) out[c].
The order of every add depends only on N, C, rows_per_block and lanes (fixed per device kind): the same
bits every run, no atomics. At N=16384 rows, C=768: 24 x 64 blocks of 256 threads, then 768 threads x 64 rows.

x and out may be float32, float64 or uint16 (bf16 bits; read through llmz.kernels.bf16's load, out written
through store / store_add: the float64 sum added to out's value, rounded to float32 then to nearest bf16);
the partial sums stay float64.

Other kernels with the same shape of problem (layernorm's dweight and dbias) reuse the pieces: colsum_geometry
for the launch, stage_rows / strip_partial in their own stage-1 kernel, sum_partials in their stage 2.
"""
import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, store, store_add

# columns per stage-1 block: one warp reads 32 consecutive columns of a row
COLSUM_STRIP = 32
# rows per stage-1 block and lanes (threadIdx.y) per block: on the GPU 256 rows, 32 x 8 = 256 threads; the
# simulator runs each thread as a Python thread, so there: chunks of 8 rows, 32 x 4 threads
COLSUM_ROWS, COLSUM_LANES = 256, 8
COLSUM_ROWS_SIM, COLSUM_LANES_SIM = 8, 4
# the most lanes the shared buffer of strip_partial holds (32 x 32 = 1024 threads)
MAX_LANES = 32


# ---- NumPy reference ----------------------------------------------------------------------------
def column_sum_ref(out, x, accumulate=True):
    """out: (C,); x: (..., C). Accumulates (+=) the sums over all rows of x into out (accumulate=False:
    overwrites out). Sums in float64 as the kernel does; out keeps its dtype (uint16: bf16 bits, the
    float64 sum added to out's float32 value, rounded to nearest)."""
    if is_bf16(out) or is_bf16(x):
        return run_in_f32(lambda o, v: column_sum_ref(o, v, accumulate), (out, x), written=(0,))
    C = x.shape[-1]
    s = x.reshape(-1, C).sum(axis=0, dtype=np.float64)
    out[...] = out + s if accumulate else s


# ---- the pieces a two-stage kernel is built from ----------------------------------------------------
def colsum_geometry(dev, N: int, C: int, rows_per_block: int | None = None):
    """Stage 1's launch for N rows and C columns: (grid, block, R, rows_per_block); the partial-sum
    scratch is (R, C) float64. R >= 1, so N = 0 gives one block of zero sums."""
    sim = dev.kind == "sim"
    rows = rows_per_block or (COLSUM_ROWS_SIM if sim else COLSUM_ROWS)
    lanes = COLSUM_LANES_SIM if sim else COLSUM_LANES
    R = max(1, ceil_div(N, rows))
    return (ceil_div(C, COLSUM_STRIP), R), (COLSUM_STRIP, lanes), R, rows


@cuda.jit(device=True)
def stage_rows(N, rows_per_block):
    """In a stage-1 block: (c, first, end, step), this thread's column and its rows range(first, end, step)
    of the block's chunk. The caller checks c < C."""
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    row0 = cuda.blockIdx.y * rows_per_block
    return c, row0 + cuda.threadIdx.y, min(row0 + rows_per_block, N), cuda.blockDim.y


@cuda.jit(device=True)
def strip_partial(buf, acc, partial, c):
    """Every thread of a stage-1 block calls this with `acc`, its float64 sum over its rows of column c
    (0 where c is out of range). Overwrites partial[blockIdx.y, c] with the sum of the block's lanes, in
    lane order. buf: shared (MAX_LANES, COLSUM_STRIP) float64, free for reuse on return."""
    tx = cuda.threadIdx.x
    buf[cuda.threadIdx.y, tx] = acc
    cuda.syncthreads()
    # lane 0 adds the lanes in order
    if cuda.threadIdx.y == 0 and c < partial.shape[1]:
        s = 0.0
        for lane in range(cuda.blockDim.y):
            s += buf[lane, tx]
        partial[cuda.blockIdx.y, c] = s
    cuda.syncthreads()                  # everyone is done with buf before it is reused


@cuda.jit(device=True)
def sum_partials(partial, c):
    """Stage 2: the float64 sum of partial[0:R, c], in row order."""
    s = 0.0
    for r in range(partial.shape[0]):
        s += partial[r, c]
    return s


# ---- Numba kernels ------------------------------------------------------------------------------
@cuda.jit
def column_sum_partial_kernel(partial, x, rows_per_block):
    """partial: (R,C) float64; x: (N,C). Stage 1, grid (ceil(C/32), R), block (32, lanes).
    Overwrites partial[blockIdx.y, columns of this strip]."""
    N, C = x.shape
    buf = cuda.shared.array((MAX_LANES, COLSUM_STRIP), numba.float64)
    c, first, end, step = stage_rows(N, rows_per_block)
    # this thread's rows of the chunk, in order, in float64
    acc = 0.0
    if c < C:
        for row in range(first, end, step):
            acc += load(x, (row, c))
    # the block's lanes, in order
    strip_partial(buf, acc, partial, c)


@cuda.jit
def column_sum_final_kernel(out, partial, accumulate):
    """out: (C,); partial: (R,C) float64. Stage 2, one thread per column. Accumulates (+=) into out
    (accumulate False: overwrites)."""
    c = cuda.grid(1)
    if c < out.shape[0]:
        s = sum_partials(partial, c)
        if accumulate:
            store_add(out, c, s)
        else:
            store(out, c, s)


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def column_sum(dev, out, x, accumulate: bool = True, rows_per_block: int | None = None) -> None:
    """out: (C,); x: (..., C). Accumulates (+=) the column sums of x into out (accumulate=False: overwrites).
    Uses dev.scratch("colsum", (R, C), float64) for the partial sums."""
    if not dev.kernels:
        return column_sum_ref(out, x, accumulate)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    grid, block, R, rows = colsum_geometry(dev, x2.shape[0], C, rows_per_block)
    partial = dev.scratch("colsum", (R, C), np.float64)
    dev.launch(column_sum_partial_kernel, grid, block, partial, x2, rows)
    dev.launch(column_sum_final_kernel, ceil_div(C, dev.block_size), dev.block_size, out, partial,
               bool(accumulate))
