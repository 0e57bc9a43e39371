"""Column sums (matmul's bias gradient), version by version (llm.c's dev/cuda role): each version checked
against the float64 reference on fresh random bf16 inputs and timed at the bias gradients of d12..d48
(dout (B*T, OC), OC = 3C, C, 4C), a table last (dev/harness.py).

    python dev/column_sum.py [--model d48] [-b 8] [VERSION ...]

version 1: teaching (llmz.kernels.matmul's bias kernel): a thread a column over all rows, float64
version 2: fast set (llmz.fast.column_sum): 64-column strips of words, 2 stages in 1 launch (d48: ~71 us, 18%)
version 3: 256-column strips of units, 4 rows in flight; predicts d48 fc bias 30 us; not yet run on a GPU
"""
import os
import sys

import numba
import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.vectors import UNIT, load8, units_fit
from llmz.fast import column_sum as fast
from llmz.fast.column_sum import last_in_strip
from llmz.fast.device_helpers import loads_barrier
from llmz.kernels.bf16 import store_add
from llmz.kernels.grid import ceil_div
from llmz.kernels.matmul import matmul_backward_bias_kernel

# ---- version 3: strips of 256 columns in units of 8 --------------------------------------------------------
# stage 1  grid (ceil(C/256), R): block (x, y) takes a strip of STRIP_UNITS = 32 units (256 columns) and a
#          chunk of rows_per_block rows; threads (32 units) x (LANES): lane y takes rows y, y+LANES, ... of the
#          chunk, ROW_BATCH = 4 rows loaded before they are added. Each thread sums its 8 columns in float64,
#          the lanes are added in lane order and the block writes partial[y, its columns] (float64 (R, C)).
# stage 2  in the block that finishes its strip last (llmz.fast.column_sum.last_in_strip): lane y sums partial
#          rows y, y+LANES, ... in order, the lanes in lane order, and the sum goes into out[c].
# The geometry: at most MAX_CHUNKS = 32 chunks of at least MIN_CHUNK_ROWS = 64 rows (N = 8192, C = 6400, d48's
# fc bias: 25 strips x 32 chunks = 800 blocks of 256 threads, 256 rows each, 8 batches of 4 a thread).
# Contract: llmz.fast.column_sum's (a float64 sum in a fixed order, rounded once into out).
STRIP_UNITS = 32                # units per stage-1 block (threadIdx.x)
LANES, LANES_SIM = 8, 2         # threadIdx.y on the GPU; in the simulator (each thread a Python thread)
ROW_BATCH = 4                   # rows a thread loads before adding them
BATCH_VALUES = ROW_BATCH * UNIT  # the values of those rows a thread holds
MAX_CHUNKS = 32                 # row chunks (stage-1 blocks a strip) at most
MIN_CHUNK_ROWS = 64             # rows a chunk at least (unless N is smaller)


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


def column_sum_units(dev, out, x, rows_per_block: int | None = None) -> None:
    """llmz.fast.column_sum.column_sum's call: the unit kernel where x is float32 or bf16 with C % 8 == 0,
    contiguous and on 16 bytes; else the teaching kernel."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C)
    if C % UNIT or not units_fit(x2):
        dev.launch(matmul_backward_bias_kernel, ceil_div(C, dev.block_size), dev.block_size, out, x2)
        return
    column_sum_into(dev, out, None, x2, rows_per_block)


# ---- the versions -------------------------------------------------------------------------------------
def teaching(dev, out, x):
    OC = x.shape[1]
    dev.launch(matmul_backward_bias_kernel, ceil_div(OC, 256), 256, out, x)


VERSIONS = {v: (name, lambda dev, d, case, fn=fn: fn(dev, d["out"], d["x"]))
            for v, (name, fn) in {1: ("teaching: a thread per column", teaching),
                                  2: ("words of two, 64-column strips (fast set)", fast.column_sum),
                                  3: ("units of 8, 256-column strips (candidate)", column_sum_units)}.items()}


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
