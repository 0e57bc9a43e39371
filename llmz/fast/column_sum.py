"""The one-launch column sums: out (C,) += x (N,C) summed over the N rows, deterministic and parallel. They
replace llmz/kernels/matmul.py's matmul_backward_bias_kernel (one thread per column looping over all N rows:
only C threads, each N dependent adds) as matmul's bias gradient, and add layernorm's per-team partial sums
into dweight and dbias (llmz.fast.layernorm). Contract: the same float64 sum in another fixed order, rounded
once into out: within one rounding of the teaching kernel's result (float32: an ulp; bf16: a bf16 step).

x is float32 or bf16 (uint16 bits) with C % 8 == 0, read in units of 8 columns (llmz.fast.vectors: 16-byte
loads); other x take the teaching kernel.

  stage 1  grid (ceil(C/256), R): block (x, y) takes a strip of STRIP_UNITS = 32 units (256 columns) and a
           chunk of rows_per_block rows; threads (32 units) x (LANES): a warp reads 512 (bf16) or 1024
           (float32) contiguous bytes of a row, lane y takes rows y, y+LANES, ... of the chunk, ROW_BATCH = 4
           rows loaded before they are added. Each thread sums its 8 columns in float64, the lanes are added
           in lane order and the block writes partial[y, its columns] (float64 (R, C) scratch).
  stage 2  in the block that finishes its strip last (last_in_strip: each block counts itself on an int32
           counter per strip; the one that counts R reads the strip's partials and resets the counter, CUDA's
           threadFenceReduction sample): lane y sums partial rows y, y+LANES, ... in order, the lanes in lane
           order, and the sum goes into out[c]. Which block that is changes from run to run; what it adds, and
           in which order, does not (the order depends only on N, C, rows_per_block and LANES).
The geometry (colsum_geometry): at most MAX_CHUNKS = 32 chunks of at least MIN_CHUNK_ROWS = 64 rows, so that
stage 2 reads at most 32 partials a column. (N = 8192, C = 6400, d48's fc bias: 25 strips x 32 chunks = 800
blocks of 256 threads, 256 rows each, 8 batches of 4 a thread.)
"""
import numba
import numpy as np
from numba import cuda

from ..device import ceil_div
from ..kernels.bf16 import store_add
from ..kernels.matmul import matmul_backward_bias_kernel
from .device_helpers import loads_barrier
from .vectors import UNIT, load8, units_fit

STRIP_UNITS = 32                # units per stage-1 block (threadIdx.x)
LANES, LANES_SIM = 8, 2         # threadIdx.y on the GPU; in the simulator (each thread a Python thread)
ROW_BATCH = 4                   # rows a thread loads before adding them
BATCH_VALUES = ROW_BATCH * UNIT  # the values of those rows a thread holds
MAX_CHUNKS = 32                 # row chunks (stage-1 blocks a strip) at most
MIN_CHUNK_ROWS = 64             # rows a chunk at least (unless N is smaller)


# ---- the pieces of a two-stage kernel ------------------------------------------------------------------
def colsum_geometry(dev, N: int, C: int, rows_per_block: int | None = None):
    """The launch for N rows and C columns: (grid, block, R, rows_per_block); the partial-sum scratch is (R, C)
    float64, the counters (grid[0],) int32. R >= 1, so N = 0 gives one block of zero sums."""
    lanes = LANES_SIM if dev.kind == "sim" else LANES
    if rows_per_block is None:
        chunks = max(1, min(MAX_CHUNKS, ceil_div(N, MIN_CHUNK_ROWS)))
        rows_per_block = max(1, ceil_div(ceil_div(N, chunks), lanes) * lanes)
    R = max(1, ceil_div(N, rows_per_block))
    return (ceil_div(C // UNIT, STRIP_UNITS), R), (STRIP_UNITS, lanes), R, rows_per_block


@cuda.jit(device=True)
def last_in_strip(flag, counters):
    """Every thread of a stage-1 block calls this right after the block's lane-0 threads wrote its partial
    sums. Counts the block on counters[blockIdx.x] (int32, 0 before the strip's first block counts) and
    returns, in every thread, whether this block is the strip's last of gridDim.y to count; that block resets
    the counter to 0 (the next launch, or the next replay of a CUDA graph, starts from 0), and its threads
    then see every block's partial sums of the strip. flag: shared (1,) int32."""
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
            # their fence and count (in hardware it also drops stale L1 lines of a neighbouring strip's)
            cuda.threadfence()
        flag[0] = 1 if last else 0
    cuda.syncthreads()
    return flag[0] != 0


@cuda.jit(device=True)
def lanes_in_order8(buf, acc):
    """Every thread of a (32 units) x (lanes) block calls this with its 8 float64 sums `acc` (a local array,
    overwritten): afterwards acc holds, in lane 0, the sums of its unit's lanes in lane order. buf: shared
    (LANES, UNIT, STRIP_UNITS) float64, free for reuse on return."""
    tx, y = cuda.threadIdx.x, cuda.threadIdx.y
    for j in range(UNIT):
        buf[y, j, tx] = acc[j]
    cuda.syncthreads()
    if y == 0:
        for j in range(UNIT):
            s = numba.float64(0.0)
            for lane in range(cuda.blockDim.y):
                s += buf[lane, j, tx]
            acc[j] = s
    cuda.syncthreads()                  # everyone is done with buf before it is reused


# ---- Numba kernel --------------------------------------------------------------------------------------
@cuda.jit
def column_sum_units_kernel(out_lo, out_hi, split, partial, counters, x, rows_per_block):
    """x: (N*C,) flat float32 or bf16, C % 8 == 0; partial: (R, C) float64 scratch; counters: (ceil(C/256),)
    int32, zero (and left zero); out_lo (split,), out_hi (C - split,): column c < split goes to out_lo[c], the
    others to out_hi[c - split] (empty when split = C). Grid (ceil(C/256), R), block (32, lanes).
    Overwrites partial[blockIdx.y, columns of this strip]; the strip's last block accumulates (+=) the sums."""
    C = partial.shape[1]
    U = C // UNIT
    N = x.shape[0] // C
    tx, y, lanes = cuda.threadIdx.x, cuda.threadIdx.y, cuda.blockDim.y
    buf = cuda.shared.array((LANES, UNIT, STRIP_UNITS), numba.float64)
    flag = cuda.shared.array(1, numba.int32)
    acc = cuda.local.array(UNIT, numba.float64)
    v = cuda.local.array(BATCH_VALUES, numba.float32)
    u = cuda.blockIdx.x * STRIP_UNITS + tx
    c = UNIT * min(u, U - 1)            # a unit past the end sums unit U-1 and drops it
    for j in range(UNIT):
        acc[j] = 0.0
    # stage 1: this thread's rows of the chunk, ROW_BATCH at a time (loads first), each column in row order
    row = cuda.blockIdx.y * rows_per_block + y
    end = min((cuda.blockIdx.y + 1) * rows_per_block, N)
    while row + (ROW_BATCH - 1) * lanes < end:
        for b in range(ROW_BATCH):
            e = (row + b * lanes) * C + c
            v[8 * b], v[8 * b + 1], v[8 * b + 2], v[8 * b + 3], v[8 * b + 4], v[8 * b + 5], v[8 * b + 6], \
                v[8 * b + 7] = load8(x, e)
        loads_barrier()
        for b in range(ROW_BATCH):
            for j in range(UNIT):
                acc[j] += v[8 * b + j]
        row += ROW_BATCH * lanes
    while row < end:
        v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7] = load8(x, row * C + c)
        for j in range(UNIT):
            acc[j] += v[j]
        row += lanes
    # the block's lanes in order, written as the chunk's partial sums
    lanes_in_order8(buf, acc)
    if y == 0 and u < U:
        for j in range(UNIT):
            partial[cuda.blockIdx.y, c + j] = acc[j]
    # stage 2, in the strip's last block only: the R partials, lane y rows y, y+lanes, ..., then the lanes
    if not last_in_strip(flag, counters):
        return
    for j in range(UNIT):
        acc[j] = 0.0
    for r in range(y, partial.shape[0], lanes):
        for j in range(UNIT):
            acc[j] += partial[r, c + j]
    lanes_in_order8(buf, acc)
    if y == 0 and u < U:
        for j in range(UNIT):
            if c + j < split:
                store_add(out_lo, c + j, acc[j])
            else:
                store_add(out_hi, c + j - split, acc[j])


# ---- the layer ---------------------------------------------------------------------------------
def column_sum_into(dev, out_lo, out_hi, x, rows_per_block: int | None = None) -> None:
    """x: (N, C) float32 or bf16, C % 8 == 0, units_fit; out_lo: (S,), out_hi: (C - S,) (or None: out_lo is
    (C,)). Accumulates (+=) the column sums of x: columns < S into out_lo, the rest into out_hi[c - S]. Uses
    dev.scratch("colsum", (R, C), float64) for the partial sums and dev.scratch("colsum_count", (strips,),
    int32) for the blocks counted per strip (zero between launches)."""
    N, C = x.shape
    grid, block, R, rows = colsum_geometry(dev, N, C, rows_per_block)
    partial = dev.scratch("colsum", (R, C), np.float64)
    counters = dev.scratch("colsum_count", grid[0], np.int32)
    if out_hi is None:
        # one output: an empty out_hi (the simulator copies each array argument: one array passed twice
        # would have the second copy's zeros written back over the first's sums)
        out_hi = out_lo[:0]
    dev.launch(column_sum_units_kernel, grid, block, out_lo, out_hi, out_lo.size, partial, counters,
               x.reshape(-1), rows)


def column_sum(dev, out, x, rows_per_block: int | None = None) -> None:
    """out: (C,); x: (..., C). Accumulates (+=) the column sums of x into out: the unit kernel where x is
    float32 or bf16 with C % 8 == 0, contiguous and on 16 bytes; else the teaching kernel."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if C % UNIT or not units_fit(x2):
        dev.launch(matmul_backward_bias_kernel, ceil_div(C, dev.block_size), dev.block_size, out, x2)
        return
    column_sum_into(dev, out, None, x2, rows_per_block)
