"""The encoder (token + position embedding), version by version (llm.c's dev/cuda role): forward and backward,
each version checked against the float64 reference on fresh random bf16 inputs and timed at d12..d48, a
table last (dev/harness.py). The backward twice: tokens uniform over the vocabulary (runs of one position,
what `python -m llmz.bench` feeds), and Zipf-distributed like text (a few tokens hold many positions: the
longest run is the kernel's critical path).

    python dev/encoder.py [--model d48] [-b 8] [VERSION ...]

version 1: teaching (llmz.kernels.encoder): a thread an element; wte backward a thread a channel
version 2: fast set (llmz.fast.encoder; fwd and wpe bwd are v1's): wte backward by token buckets, 2-byte loads
version 3: units; wte backward 4 warps a token run; predicts near the ceiling (uniform); not yet run on a GPU
"""
import os
import sys

import numba
import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.vectors import UNIT, add_store_slots, load8, load8_into, store8, two_slots, unit_blocks, units_fit
from llmz.fast import encoder as fast
from llmz.fast.device_helpers import WARP, loads_barrier
from llmz.fast.encoder import wte_buckets, wte_table_size
from llmz.kernels import encoder as teaching
from llmz.kernels.encoder import encoder_backward_ref, encoder_forward_ref
from llmz.kernels.grid import ceil_div

# ---- version 3: units (float32 or bf16, C % 8 == 0, every array on 16 bytes) --------------------------------
#   forward        two units a thread, the token ids loaded first, then wte's and wpe's units
#   wte backward   block (32 lanes, WTE_WARPS warps) per (token run, strip of 32 units) of llmz.fast.encoder's
#                  bucket table, lane l the strip's unit l, warp w the run's positions w, w + WTE_WARPS, ...
#                  (POSITIONS at a time, their ids loaded before their rows), each in float64, the warps added
#                  in order, one rounding into dwte
#   wpe backward   a thread per (t, unit), the B rows in order in float64 (the teaching kernel's sums: its bits)
# Contract: the forward and dwpe the teaching kernels' bits; dwte as llmz.fast.encoder's (each (token,
# channel) the same terms summed in float64 and rounded once).
WTE_WARPS = 4               # warps splitting a token run's positions in the units wte backward
POSITIONS = 4               # positions a warp loads before adding them
BATCH_ROWS = 4              # rows b a wpe backward thread loads before adding them
TWO_UNITS, POSITION_VALUES, BATCH_VALUES = 2 * UNIT, POSITIONS * UNIT, BATCH_ROWS * UNIT   # local array sizes


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

def encoder_forward_units(dev, out, inp, wte, wpe) -> None:
    """llmz.fast.encoder.encoder_forward's call on units (the teaching kernel where they do not fit)."""
    T, C = out.shape[1:]
    if C % UNIT or not units_fit(out, wte, wpe):
        return teaching.encoder_forward(dev, out, inp, wte, wpe)
    dev.launch(encoder_forward_units_kernel, unit_blocks(dev, out.size), dev.block_size, out.reshape(-1),
               inp.reshape(-1), wte.reshape(-1), wpe.reshape(-1), C, T, out.size // UNIT)


def encoder_backward_units(dev, dwte, dwpe, dout, inp, buckets) -> None:
    """llmz.fast.encoder.encoder_backward's call (buckets: the device copy of wte_buckets(inp)) on units
    (llmz.fast.encoder's kernels where they do not fit)."""
    B, T, C = dout.shape
    if C % UNIT or not units_fit(dwte, dwpe, dout):
        return fast.encoder_backward(dev, dwte, dwpe, dout, inp, buckets)
    assert buckets.shape == (wte_table_size(B * T),), (buckets.shape, B, T)
    bs = dev.block_size
    dev.launch(encoder_backward_wpe_units_kernel, ceil_div(T * C // UNIT, bs), bs, dwpe.reshape(-1),
               dout.reshape(-1), B, T, C)
    dev.launch(encoder_backward_wte_units_kernel, (B * T, ceil_div(C // UNIT, WARP)), (WARP, WTE_WARPS),
               dwte.reshape(-1), dout.reshape(-1), buckets, C)


# ---- the versions of each case --------------------------------------------------------------------------
FORWARD = {1: teaching.encoder_forward, 3: encoder_forward_units}     # the fast set's forward is version 1
BACKWARD = {1: lambda dev, d: teaching.encoder_backward(dev, d["dwte"], d["dwpe"], d["dout"], d["inp"]),
            2: lambda dev, d: fast.encoder_backward(dev, d["dwte"], d["dwpe"], d["dout"], d["inp"], d["buckets"]),
            3: lambda dev, d: encoder_backward_units(dev, d["dwte"], d["dwpe"], d["dout"], d["inp"], d["buckets"])}
CASES = {"forward": {v: (lambda dev, d, fn=fn: fn(dev, d["out"], d["inp"], d["wte"], d["wpe"]))
                     for v, fn in FORWARD.items()},
         "backward, uniform tokens": BACKWARD, "backward, Zipf tokens": BACKWARD}
NAMES = {1: "teaching", 2: "token buckets, 2-byte loads (fast set)", 3: "units (candidate)"}
VERSIONS = harness.case_versions(NAMES, CASES)


def tokens(B, T, V, zipf: bool) -> np.ndarray:
    rng = np.random.default_rng()
    if zipf:
        return np.minimum(rng.zipf(1.2, (B, T)) - 1, V - 1).astype(np.int32)
    return rng.integers(0, V, (B, T)).astype(np.int32)


def cases(cfg, B):
    import cupy as cp
    T, C, V, Vp = harness.T, cfg.channels, cfg.vocab_size, cfg.padded_vocab_size
    n = B * T * C

    def make(zipf):
        def arrays():
            inp = tokens(B, T, V, zipf)
            return {"inp": cp.asarray(inp), "buckets": cp.asarray(wte_buckets(inp)), "wte": harness.rand((Vp, C)),
                    "wpe": harness.rand((T, C)), "out": cp.zeros((B, T, C), cp.uint16),
                    "dout": harness.rand((B, T, C)), "dwte": harness.rand((Vp, C)), "dwpe": harness.rand((T, C))}
        return arrays

    def forward_ref(d):
        out = np.empty((B, T, C))
        encoder_forward_ref(out, harness.host(d["inp"]), harness.host(harness.f64(d["wte"])),
                            harness.host(harness.f64(d["wpe"])))
        return {"out": cp.asarray(out)}

    def backward_ref(d):
        dwte, dwpe = harness.host(harness.f64(d["dwte"])), harness.host(harness.f64(d["dwpe"]))
        encoder_backward_ref(dwte, dwpe, harness.host(harness.f64(d["dout"])), harness.host(d["inp"]))
        return {"dwte": cp.asarray(dwte), "dwpe": cp.asarray(dwpe)}
    yield ("forward", make(False), ("out",), forward_ref, 4 * n + 2 * T * C, harness.BF16_TOL,
           lambda v: v in FORWARD)
    for zipf in (False, True):
        # dout read once; each position's token row and dwpe read and written (an upper bound for Zipf)
        yield (f"backward, {'Zipf' if zipf else 'uniform'} tokens", make(zipf), (), backward_ref,
               2 * n + 2 * 2 * n + 4 * T * C, harness.BF16_TOL, lambda v: True)


if __name__ == "__main__":
    sys.exit(harness.run("encoder", __doc__, VERSIONS, cases, sys.argv[1:]))
