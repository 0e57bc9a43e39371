"""The fused classifier (softmax + cross-entropy: the losses and dlogits written over the logits), version by
version (llm.c's dev/cuda role), and the losses alone (the forward), each version checked against the float64
reference on fresh random bf16 logits and timed at (B*T, Vp = 50304), a table last (dev/harness.py). Bytes:
the logits read once and written once (fused), read once (losses): what a kernel must move.

    python dev/classifier.py [--model d48] [-b 8] [VERSION ...]

version 1: teaching (llmz.kernels.classifier): forward (three reads, a probs buffer), then backward
version 2: fast set (llmz.fast.classifier): a block a row, two reads, words of two (d12: 2.75 ms, 12.5%)
version 3: bf16 row in registers, one read, one write; predicts fused 590 us (65%); not yet run on a GPU
The rows of every model size are alike (Vp is the vocabulary's): the sizes differ only in B*T.
"""
import functools
import math
import os
import sys

import numba
import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.vectors import LOG2E, UNIT, bf16_pair, exp2_approx, load16, pack_bf16x2, store16, units_fit
from llmz.fast import classifier as fast
from llmz.fast.device_helpers import WARP, bounded_jit, softmax_combine, warp_max_sum
from llmz.kernels import classifier as teaching
from llmz.kernels.bf16 import load
from llmz.kernels.grid import ceil_div

# ---- version 3: the row in registers (bf16 logits, Vp % 8 == 0, on 16 bytes: GPT-2's bf16 runs) ------------
# units_kernel(Vp, threads), built per padded vocabulary, one block of UNITS_THREADS = 1024 per row, each
# thread holding its ceil(Vp / 8 / 1024) units (Vp = 50304: 7 units, 28 words of two bf16) as they were loaded,
# all issued first. The row max and the sum of exp(x - max) come from the registers (each thread's max, then
# its sum against it), one (max, sum) reduction over the block, and the dlogits are written from the same
# registers: one read and one write of the row. classifier_loss runs the same kernel without the write.
# Contract: each thread's exponentials summed in float32, the warps' sums in float64; losses within 1e-6
# relative of the float64 reference, bf16 dlogits within one bf16 step of the rounded reference.
# Threads per row: ptxas must fit the kernel in 64 registers a thread (launch bounds 1024 x 1), so one block
# an SM holds ~112 KB of loads in flight (Vp = 50304).
UNITS_THREADS = 1024
NEG_INF = np.float32(-np.inf)
ZERO32 = np.float32(0.0)


@cuda.jit(device=True)
def block_max_sum(m, s, buf_m, buf_s):
    """Every thread's (max m, sum s of exp(x - m)), float32 -> the row's (max, sum) in float64, in every
    thread: each warp's butterfly (warp_max_sum), then the warps in order (softmax_combine). buf_m, buf_s:
    shared (32,) float32 and float64."""
    m, s = warp_max_sum(m, s)
    warp = cuda.threadIdx.x // WARP
    if cuda.threadIdx.x % WARP == 0:
        buf_m[warp] = m
        buf_s[warp] = s
    cuda.syncthreads()
    mt = buf_m[0]
    st = buf_s[0]
    for v in range(1, cuda.blockDim.x // WARP):
        mt, st = softmax_combine(mt, st, buf_m[v], buf_s[v])
    return mt, st


@functools.cache
def units_kernel(Vp: int, threads: int):
    """The classifier kernel for bf16 rows of Vp (% 8 == 0) logits, `threads` a block (a multiple of 32)."""
    U = Vp // UNIT                      # units in a row
    UPT = ceil_div(U, threads)          # units a thread holds
    NW = 4 * UPT                        # their words
    STEP = UNIT * threads               # columns from one of a thread's units to its next

    @bounded_jit(threads, 1)
    def classifier_units_kernel(losses, logits, targets, dloss, V, write_dlogits):
        # logits: (rows*Vp,) bf16 flat; targets, losses: (rows,). One block per row. Overwrites losses, and
        # with write_dlogits the logits with dlogits = (softmax - onehot(target)) * dloss (0 past V).
        r = cuda.blockIdx.x
        t = cuda.threadIdx.x
        base = r * Vp
        buf_m = cuda.shared.array(32, numba.float32)
        buf_s = cuda.shared.array(32, numba.float64)
        w = cuda.local.array(NW, numba.uint32)
        tgt = targets[r]
        xt = load(logits, base + tgt)       # the target's logit, before anything is written over the row
        # unit k of this thread starts at column c = t0 + STEP k: the tests c < V and c == target become
        # STEP k + j < lim and STEP k + j == tl, a constant against one number each
        t0 = UNIT * t
        lim = V - t0
        tl = tgt - t0
        e0 = base + t0
        # the row's units, all loads first (the last unit of a thread past the row: unit U-1, never used)
        for k in range(UPT):
            e = e0 + STEP * k if k < UPT - 1 else base + UNIT * min(t + threads * k, U - 1)
            w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3] = load16(logits, e)
        # this thread's max, then its sum of exp(x - max), over its columns < V
        m = NEG_INF
        for k in range(UPT):
            for i in range(4):
                lo, hi = bf16_pair(w[4 * k + i])
                if STEP * k + 2 * i < lim:
                    m = max(m, lo)
                if STEP * k + 2 * i + 1 < lim:
                    m = max(m, hi)
        s = ZERO32
        base2 = m * LOG2E
        for k in range(UPT):
            for i in range(4):
                lo, hi = bf16_pair(w[4 * k + i])
                if STEP * k + 2 * i < lim:
                    s += exp2_approx(lo * LOG2E - base2)
                if STEP * k + 2 * i + 1 < lim:
                    s += exp2_approx(hi * LOG2E - base2)
        # the row's max and sum (float64)
        mx, total = block_max_sum(m, numba.float64(s), buf_m, buf_s)
        if t == 0:
            losses[r] = math.log(total) - (xt - mx)
        if not write_dlogits:
            return
        # dlogits = (exp(x - max) / sum - onehot) * dloss from the registers; 0 on the padded columns
        scale = numba.float32(dloss / total)
        mxl = numba.float32(mx) * LOG2E
        dl = numba.float32(dloss)
        for k in range(UPT):
            if t + threads * k < U:
                for i in range(4):
                    lo, hi = bf16_pair(w[4 * k + i])
                    c = STEP * k + 2 * i
                    d0 = exp2_approx(lo * LOG2E - mxl) * scale - (dl if c == tl else ZERO32) if c < lim else ZERO32
                    d1 = exp2_approx(hi * LOG2E - mxl) * scale - (dl if c + 1 == tl else ZERO32) \
                        if c + 1 < lim else ZERO32
                    w[4 * k + i] = pack_bf16x2(d0, d1)
                store16(logits, e0 + STEP * k, w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3])
    return classifier_units_kernel


def units_threads(dev) -> int:
    """Threads per row of the units kernel: UNITS_THREADS on the GPU, dev.block_size in the simulator."""
    return dev.block_size if dev.kind == "sim" else UNITS_THREADS


def row_units_apply(x) -> bool:
    """The units kernel applies to the (rows, Vp) logits x: bf16, Vp % 8 == 0, on 16 bytes."""
    return x.dtype == np.uint16 and x.shape[-1] % UNIT == 0 and units_fit(x)


def classifier_units(dev, losses, x, targets, dloss, vocab_size, write_dlogits) -> None:
    """The units kernel over the (rows, Vp) bf16 logits x (row_units_apply)."""
    rows, Vp = x.shape
    nt = units_threads(dev)
    dev.launch(units_kernel(Vp, nt), rows, nt, losses.reshape(-1), x.reshape(-1), targets.reshape(-1),
               float(dloss), vocab_size, write_dlogits)


def classifier_fused_units(dev, losses, logits, targets, dloss, vocab_size) -> None:
    """llmz.fast.classifier.classifier_fused's call: the units kernel where it applies, else llmz.fast's."""
    x = logits.reshape(-1, logits.shape[-1])
    if not row_units_apply(x):
        return fast.classifier_fused(dev, losses, logits, targets, dloss, vocab_size)
    classifier_units(dev, losses, x, targets, dloss, vocab_size, True)


def classifier_loss_units(dev, losses, logits, targets, vocab_size) -> None:
    """llmz.fast.classifier.classifier_loss's call: the units kernel where it applies, else llmz.fast's."""
    x = logits.reshape(-1, logits.shape[-1])
    if not row_units_apply(x):
        return fast.classifier_loss(dev, losses, logits, targets, vocab_size)
    classifier_units(dev, losses, x, targets, 0.0, vocab_size, False)


# ---- the versions of each case --------------------------------------------------------------------------
DLOSS = 1.0 / 8192
FUSED = {1: teaching.classifier_fused, 2: fast.classifier_fused, 3: classifier_fused_units}
LOSSES = {1: teaching.classifier_loss, 2: fast.classifier_loss, 3: classifier_loss_units}
CASES = {"fused": {v: (lambda dev, d, fn=fn: fn(dev, d["losses"], d["logits"], d["targets"], DLOSS, d["V"].size))
                   for v, fn in FUSED.items()},
         "losses": {v: (lambda dev, d, fn=fn: fn(dev, d["losses"], d["logits"], d["targets"], d["V"].size))
                    for v, fn in LOSSES.items()}}
NAMES = {1: "teaching", 2: "two reads, words of two (fast set)", 3: "units, row in registers (candidate)"}
VERSIONS = harness.case_versions(NAMES, CASES)


def cases(cfg, B):
    import cupy as cp
    N, V, Vp = B * harness.T, cfg.vocab_size, cfg.padded_vocab_size

    def make():
        return {"logits": harness.rand((N, Vp), 3.0), "losses": cp.zeros(N, cp.float32),
                "targets": cp.random.randint(0, V, N).astype(cp.int32), "V": cp.empty(V, cp.uint8)}

    def reference(fused):
        def ref(d):
            x = harness.f64(d["logits"])[:, :V]
            m = x.max(axis=1)
            e = cp.exp(x - m[:, None])
            s = e.sum(axis=1)
            rows = cp.arange(N)
            t = d["targets"].astype(cp.int64)
            want = {"losses": cp.log(s) - (x[rows, t] - m)}
            if fused:
                dl = cp.zeros((N, Vp))
                dl[:, :V] = e / s[:, None]
                dl[rows, t] -= 1.0
                want["logits"] = dl * DLOSS
            return want
        return ref
    row = N * Vp * 2
    yield "fused", make, ("losses",), reference(True), 2 * row + 8 * N, harness.BF16_TOL, lambda v: True
    yield "losses", make, ("losses",), reference(False), row + 8 * N, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("classifier", __doc__, VERSIONS, cases, sys.argv[1:]))
