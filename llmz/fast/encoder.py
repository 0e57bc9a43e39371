"""The encoder's fast kernels (llm.c's train_gpt2.cu, llmc/encoder.cuh). The math, shapes and dtypes are
llmz/kernels/encoder.py's.

encoder_backward_wte_bucket_kernel replaces the teaching encoder_backward_wte_kernel (one thread per channel
walking all B*T positions: only C threads): the host sorts the batch's positions by token id (wte_buckets,
built while the batch is uploaded, outside the captured step); one block per distinct token, its threads over
the channels, each thread summing its token's positions in order in float64 and adding once into
dwte[token, c]. Deterministic, no atomics.
Units (float32 or bf16, C % 8 == 0, every array on 16 bytes: llmz.fast.vectors' 16-byte loads of 8
channels), GPT-2's case:
  forward        encoder_forward_units_kernel replaces encoder_forward_kernel (one thread per element): two
                 units a thread, the token ids loaded first, then wte's and wpe's units
  wte backward   encoder_backward_wte_units_kernel: block (32 lanes, WTE_WARPS warps) per (token run, strip
                 of 32 units), lane l the strip's unit l, warp w the run's positions w, w + WTE_WARPS, ...
                 (4 at a time, their ids loaded before their rows: a frequent token's long run is read by
                 all the warps at once), each in float64, the warps added in order, one rounding into dwte
  wpe backward   encoder_backward_wpe_units_kernel replaces encoder_backward_wpe_kernel: a thread per (t,
                 unit), the B rows in order in float64 (the teaching kernel's sums: its bits)
Contract: the forward and dwpe the teaching kernels' bits; each (token, channel) of dwte gets the same terms,
summed in float64 and rounded once, where the teaching kernel rounds after each add: a token seen k times
may differ by up to k roundings (float32 ulps, or bf16 steps, of the partial sums).

The bucket table, one flat int32 array of fixed size 3*n + 2 for n = B*T positions (allocated once, refilled
every batch), U distinct tokens:
    table[0]               U
    table[1 : n+2]         run starts: token run i covers sorted[starts[i] : starts[i+1]]; starts[U] = n,
                           entries after it are n too
    table[n+2 : 2n+2]      the token id of run i (i < U), increasing; -1 after
    table[2n+2 : 3n+2]     sorted: the positions b*T+t, stably sorted by token id (ties in increasing position)
"""
import numba
import numpy as np
from numba import cuda

from ..device import ceil_div
from ..kernels import encoder as teaching
from ..kernels.bf16 import load, store_add
from ..kernels.encoder import encoder_backward_wpe_kernel
from .device_helpers import WARP, loads_barrier
from .vectors import UNIT, add_store_slots, load8, load8_into, store8, two_slots, unit_blocks, units_fit

WTE_WARPS = 4               # warps splitting a token run's positions in the units wte backward
POSITIONS = 4               # positions a warp loads before adding them
BATCH_ROWS = 4              # rows b a wpe backward thread loads before adding them
TWO_UNITS, POSITION_VALUES, BATCH_VALUES = 2 * UNIT, POSITIONS * UNIT, BATCH_ROWS * UNIT   # local array sizes


@cuda.jit
def encoder_backward_wte_bucket_kernel(dwte, dout, table):
    """dwte: (Vp,C); dout: (n,C), n = B*T; table: wte_buckets(inp), (3n+2,) int32. Grid (n, gy), 1-D blocks:
    block x owns token run x (blocks x >= U exit); its threads stride over the channels. Each thread sums
    its run's positions in order in float64 and adds once. Accumulates (+=) into dwte."""
    n, C = dout.shape
    run = cuda.blockIdx.x
    if run >= table[0]:
        return
    start = table[1 + run]
    end = table[2 + run]
    token = table[n + 2 + run]
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    while c < C:
        # the token's positions, in increasing order
        acc = 0.0
        for k in range(start, end):
            acc += load(dout, (table[2 * n + 2 + k], c))
        store_add(dwte, (token, c), acc)
        c += cuda.gridDim.y * cuda.blockDim.x


@cuda.jit
def encoder_forward_units_kernel(out, inp, wte, wpe, C, T, n_units):
    """out: (B*T*C,) flat; inp: (B*T,) int32; wte: (Vp*C,), wpe: (maxT*C,) flat; C % 8 == 0. Thread i takes
    units i and i + S of out. Overwrites out."""
    i0, i1, e0, e1 = two_slots(n_units)
    x = cuda.local.array(TWO_UNITS, numba.float32)
    p = cuda.local.array(TWO_UNITS, numba.float32)
    # the two units' rows, their token ids, then the wte and wpe units
    r0, r1 = e0 // C, e1 // C
    tok0, tok1 = inp[r0], inp[r1]
    c0, c1 = e0 - r0 * C, e1 - r1 * C
    load8_into(x, 0, wte, tok0 * C + c0)
    load8_into(x, UNIT, wte, tok1 * C + c1)
    load8_into(p, 0, wpe, (r0 % T) * C + c0)
    load8_into(p, UNIT, wpe, (r1 % T) * C + c1)
    loads_barrier()
    add_store_slots(out, x, p, i0, i1, e0, e1, n_units)


@cuda.jit
def encoder_backward_wte_units_kernel(dwte, dout, table, C):
    """dwte: (Vp*C,), dout: (n*C,) flat, n = B*T; table: wte_buckets, (3n+2,) int32. Grid (n, ceil(C/256)),
    block (32, WTE_WARPS): block (x, y) owns token run x (blocks x >= U exit) and units 32y.. of the row.
    Accumulates (+=) into dwte."""
    n = dout.shape[0] // C
    run = cuda.blockIdx.x
    if run >= table[0]:
        return
    lane, warp = cuda.threadIdx.x, cuda.threadIdx.y
    U = C // UNIT
    u = cuda.blockIdx.y * WARP + lane
    c = UNIT * min(u, U - 1)
    start, end = table[1 + run], table[2 + run]
    buf = cuda.shared.array((WTE_WARPS, UNIT, WARP), numba.float64)
    acc = cuda.local.array(UNIT, numba.float64)
    v = cuda.local.array(POSITION_VALUES, numba.float32)
    for j in range(UNIT):
        acc[j] = 0.0
    # this warp's positions of the run: POSITIONS at a time, their ids first, then their rows
    k = start + warp
    while k < end:
        for q in range(POSITIONS):
            kq = min(k + q * WTE_WARPS, end - 1)
            load8_into(v, UNIT * q, dout, table[2 * n + 2 + kq] * C + c)
        loads_barrier()
        for q in range(POSITIONS):
            if k + q * WTE_WARPS < end:
                for j in range(UNIT):
                    acc[j] += v[UNIT * q + j]
        k += POSITIONS * WTE_WARPS
    # the warps in order; warp 0 adds the sums into the token's row, one rounding
    for j in range(UNIT):
        buf[warp, j, lane] = acc[j]
    cuda.syncthreads()
    if warp == 0 and u < U:
        for j in range(UNIT):
            s = numba.float64(0.0)
            for w in range(WTE_WARPS):
                s += buf[w, j, lane]
            acc[j] = s
        e = table[n + 2 + run] * C + c
        d0, d1, d2, d3, d4, d5, d6, d7 = load8(dwte, e)
        store8(dwte, e, numba.float32(d0 + acc[0]), numba.float32(d1 + acc[1]), numba.float32(d2 + acc[2]),
               numba.float32(d3 + acc[3]), numba.float32(d4 + acc[4]), numba.float32(d5 + acc[5]),
               numba.float32(d6 + acc[6]), numba.float32(d7 + acc[7]))


@cuda.jit
def encoder_backward_wpe_units_kernel(dwpe, dout, B, T, C):
    """dwpe: (maxT*C,), dout: (B*T*C,) flat. A thread per (t, unit): the B rows in order, BATCH_ROWS loaded at
    a time, in float64, added once. Accumulates (+=) into dwpe."""
    i = cuda.grid(1)
    U = C // UNIT
    e = UNIT * min(i, T * U - 1)            # = t*C + 8 (i % U): the unit's offset in a (T, C) slice (a thread
    #                                         past the end takes the last unit: loads_barrier needs the whole warp)
    acc = cuda.local.array(UNIT, numba.float64)
    v = cuda.local.array(BATCH_VALUES, numba.float32)
    for j in range(UNIT):
        acc[j] = 0.0
    b = 0
    while b < B:
        for q in range(BATCH_ROWS):
            load8_into(v, UNIT * q, dout, min(b + q, B - 1) * T * C + e)
        loads_barrier()
        for q in range(BATCH_ROWS):
            if b + q < B:
                for j in range(UNIT):
                    acc[j] += v[UNIT * q + j]
        b += BATCH_ROWS
    if i >= T * U:
        return
    d0, d1, d2, d3, d4, d5, d6, d7 = load8(dwpe, e)
    store8(dwpe, e, numba.float32(d0 + acc[0]), numba.float32(d1 + acc[1]), numba.float32(d2 + acc[2]),
           numba.float32(d3 + acc[3]), numba.float32(d4 + acc[4]), numba.float32(d5 + acc[5]),
           numba.float32(d6 + acc[6]), numba.float32(d7 + acc[7]))


# ---- the bucket table (host) ------------------------------------------------------------------------
def wte_table_size(n: int) -> int:
    """int32 entries of the bucket table for n = B*T positions."""
    return 3 * n + 2


def wte_buckets(inp) -> np.ndarray:
    """inp: (B,T) int host array. The bucket table (layout in the module docstring), int32 (3*B*T + 2,)."""
    tokens = np.asarray(inp).reshape(-1)
    n = tokens.size
    # positions sorted by token id; a stable sort keeps repeated tokens in increasing position
    order = np.argsort(tokens, kind="stable")
    sorted_tokens = tokens[order]
    # a run starts where the token id changes
    starts = np.flatnonzero(np.r_[True, sorted_tokens[1:] != sorted_tokens[:-1]]) if n else np.zeros(0, int)
    U = starts.size
    table = np.empty(wte_table_size(n), np.int32)
    table[0] = U
    table[1:n + 2] = n
    table[1:U + 1] = starts
    table[n + 2:2 * n + 2] = -1
    table[n + 2:n + 2 + U] = sorted_tokens[starts]
    table[2 * n + 2:] = order
    return table


def wte_buckets_upload(dev, inp, table=None):
    """inp: (B,T) int host array. Fills this device's bucket-table scratch (allocated on first use, the
    same buffer every batch of this shape) from wte_buckets(inp) (or `table`, made from inp earlier) and
    returns it, for encoder_backward."""
    table = wte_buckets(inp) if table is None else table
    buf = dev.scratch("wte_buckets", table.size, np.int32)
    dev.copy_from_host(buf, table)
    return buf


# ---- the layer ---------------------------------------------------------------------------------
def encoder_forward(dev, out, inp, wte, wpe) -> None:
    """out: (B,T,C); inp: (B,T) int32; wte: (Vp,C); wpe: (maxT,C). Overwrites out."""
    T, C = out.shape[1:]
    if C % UNIT or not units_fit(out, wte, wpe):
        return teaching.encoder_forward(dev, out, inp, wte, wpe)
    n_units = out.size // UNIT
    dev.launch(encoder_forward_units_kernel, unit_blocks(dev, out.size), dev.block_size, out.reshape(-1),
               inp.reshape(-1), wte.reshape(-1), wpe.reshape(-1), C, T, n_units)


def encoder_backward(dev, dwte, dwpe, dout, inp, buckets=None) -> None:
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T) int32; buckets: the device copy of
    wte_buckets(inp) (None: the teaching kernels). Accumulates (+=) into dwte, dwpe."""
    if buckets is None:
        return teaching.encoder_backward(dev, dwte, dwpe, dout, inp)
    B, T, C = dout.shape
    bs = dev.block_size
    assert buckets.shape == (wte_table_size(B * T),), (buckets.shape, B, T)
    if C % UNIT or not units_fit(dwte, dwpe, dout):
        dev.launch(encoder_backward_wpe_kernel, ceil_div(T * C, bs), bs, dwpe, dout)
        dev.launch(encoder_backward_wte_bucket_kernel, (B * T, ceil_div(C, bs)), bs, dwte, dout.reshape(B * T, C),
                   buckets)
        return
    dev.launch(encoder_backward_wpe_units_kernel, ceil_div(T * C // UNIT, bs), bs, dwpe.reshape(-1),
               dout.reshape(-1), B, T, C)
    dev.launch(encoder_backward_wte_units_kernel, (B * T, ceil_div(C // UNIT, WARP)), (WARP, WTE_WARPS),
               dwte.reshape(-1), dout.reshape(-1), buckets, C)
