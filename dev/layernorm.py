"""LayerNorm, version by version (llm.c's dev/cuda role): forward, backward (dinp, dweight, dbias) and the
residual add fused into the forward, each version checked against the float64 reference on fresh random
bf16 inputs and timed at d12..d48 (B*T rows of C channels), a table last (dev/harness.py).

    python dev/layernorm.py [--model d48] [-b 8] [VERSION ...]

version 1: teaching (llmz.kernels.layernorm): a block a row, float64; dweight/dbias a thread a channel
version 2: fast set (llmz.fast.layernorm): a warp a row, 2-byte loads (d48: fwd 109 us, 11%; bwd 528 us, 5%)
version 3: per-C kernels on units, one-pass backward; predicts d48 fwd 15 us, bwd 33 us; not yet run on a GPU
version 4: the residual fused into v3's forward; predicts d48 30 us against 18 + 109 us; not yet run on a GPU
The fused case's reference is here (the residual rounded to bf16, then llmz.kernels.layernorm's
layernorm_forward_ref): no layer of the model calls the fused forward yet.
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
from dev.column_sum import column_sum_into
from dev.residual import residual_forward_units
from dev.vectors import UNIT, load8, store8, units_fit
from llmz.fast import layernorm as fast
from llmz.fast import residual as fast_residual
from llmz.fast.device_helpers import WARP, loads_barrier, warp_row, warp_sum
from llmz.kernels import layernorm as teaching
from llmz.kernels import residual as teaching_residual
from llmz.kernels.grid import ceil_div
from llmz.kernels.layernorm import LN_EPS, layernorm_backward_ref, layernorm_forward_ref

# ---- version 3 (and 4): kernels built per C on 16-byte units ------------------------------------------------
# Every kernel is built for one C (forward_kernel(C), backward_kernel(C)), so a row's units per thread are
# compile-time constants, unrolled, and the row stays in registers at every GPT-2 width (C = 1600: 7 units a
# lane, 56 floats). Float32 and bf16 rows of C % 8 == 0 channels starting on 16 bytes; others the teaching
# kernels.
#   forward   one WARP per row, WARPS_PER_BLOCK rows a block, lane l holding units l, l+32, ...; every load
#             issued before any arithmetic; the mean and the variance from the registers (each lane's sum in
#             float32, the warp's butterfly in float64); one write. With inp2 and residual (version 4): x = inp
#             + inp2 stored to residual, rounded as the residual kernel rounds it, and normalised from those
#             stored values.
#   backward  one pass over the rows: a TEAM (one block of team_warps(C) warps, thread t holding units t,
#             t + 32 TW, VPT = 2 of them) per row at a time, the team's rows row0, row0 + G, ... (G teams); inp,
#             dout and dinp read once, dinp written once; the two row means summed by the team (float32 per
#             thread, float64 across threads, warps in order); each thread adds its channels' norm * dout and
#             dout into float32 registers, written once per team to a (G, 2C) float32 scratch; then the column
#             sum adds the G partial rows into dweight and dbias (float64, fixed order).
# Contract: out, mean, rstd, dinp within 1e-6 relative (normwise) of the float64 reference in float32;
# dweight, dbias: float32 sums over each team's <= 32 rows, then float64: a few float32 ulps. The grid is a
# function of N and C only: the same bits every run. The fused forward: the residual kernel's bits, then
# the layernorm kernel's on them.
WARPS_PER_BLOCK = 4         # rows per block of the forward (one warp each)
VPT = 2                     # units per thread of the backward team
TEAM_ROWS = 32              # the most rows a backward team adds into its float32 partial sums
TEAM_WARPS_IN_FLIGHT = 2048  # warps of all teams together (~16 per SM on an H200), unless N gives fewer


def team_warps(C: int) -> int:
    """Warps of a backward team: enough threads for every unit of a row at VPT units a thread."""
    return ceil_div(C // UNIT, WARP * VPT)


def backward_teams(N: int, C: int) -> int:
    """G, the backward's teams (blocks): enough warps in flight, and no team adding more than TEAM_ROWS rows
    (its partial sums are float32); a function of N and C only, so the sums' order is too."""
    return max(1, min(N, max(TEAM_WARPS_IN_FLIGHT // team_warps(C), ceil_div(N, TEAM_ROWS))))


# ---- Numba kernels, one set per C ---------------------------------------------------------------------
@functools.cache
def forward_kernel(C: int, fused: int = 0):
    """The forward kernel for rows of C channels (C % 8 == 0); fused: with the residual add (version 4). A
    compile-time choice: Numba on a GPU cannot pass None as a kernel argument (NotImplementedError: (none,
    None) at the launch), so the plain kernel takes inp again in residual's and inp2's places, never
    read there (inp: the simulator copies each argument back, and inp's copies are all unchanged)."""
    FUSED = bool(fused)
    U = C // UNIT                   # units in a row
    UPL = ceil_div(U, WARP)         # units a lane holds
    NV = UPL * UNIT

    @cuda.jit
    def layernorm_forward_units_kernel(out, mean, rstd, inp, weight, bias, residual, inp2):
        # out, inp (and residual, inp2): (N*C,) flat; mean, rstd: (N,); weight, bias: (C,). One warp per row.
        # Overwrites out, mean, rstd (and residual = inp + inp2 when FUSED; else neither is read or written).
        row, lane = warp_row()
        if row >= mean.shape[0]:
            return
        base = row * C
        x = cuda.local.array(NV, numba.float32)
        y = cuda.local.array(NV, numba.float32)
        # the row's units, all loads first (a lane past the row's last unit loads unit U-1, never used)
        for k in range(UPL):
            e = base + UNIT * min(lane + WARP * k, U - 1)
            x[8 * k], x[8 * k + 1], x[8 * k + 2], x[8 * k + 3], x[8 * k + 4], x[8 * k + 5], x[8 * k + 6], \
                x[8 * k + 7] = load8(inp, e)
            if FUSED:
                y[8 * k], y[8 * k + 1], y[8 * k + 2], y[8 * k + 3], y[8 * k + 4], y[8 * k + 5], y[8 * k + 6], \
                    y[8 * k + 7] = load8(inp2, e)
        loads_barrier()
        # the fused residual: x = inp + inp2 as stored (rounded to the storage's precision)
        if FUSED:
            for k in range(UPL):
                u = lane + WARP * k
                if u < U:
                    j = 8 * k
                    x[j], x[j + 1], x[j + 2], x[j + 3], x[j + 4], x[j + 5], x[j + 6], x[j + 7] = store8(
                        residual, base + UNIT * u, x[j] + y[j], x[j + 1] + y[j + 1], x[j + 2] + y[j + 2],
                        x[j + 3] + y[j + 3], x[j + 4] + y[j + 4], x[j + 5] + y[j + 5], x[j + 6] + y[j + 6],
                        x[j + 7] + y[j + 7])
        # the mean: each lane's sum in float32, the warp's in float64
        acc = numba.float32(0.0)
        for k in range(UPL):
            if lane + WARP * k < U:
                for j in range(UNIT):
                    acc += x[8 * k + j]
        m = warp_sum(numba.float64(acc)) / C
        mc = numba.float32(m)
        # the biased variance, from the registers
        acc = numba.float32(0.0)
        for k in range(UPL):
            if lane + WARP * k < U:
                for j in range(UNIT):
                    d = x[8 * k + j] - mc
                    acc += d * d
        s = 1.0 / math.sqrt(warp_sum(numba.float64(acc)) / C + LN_EPS)
        sc = numba.float32(s)
        # normalise, scale and shift: one write of the row
        for k in range(UPL):
            u = lane + WARP * k
            if u < U:
                c = UNIT * u
                w0, w1, w2, w3, w4, w5, w6, w7 = load8(weight, c)
                b0, b1, b2, b3, b4, b5, b6, b7 = load8(bias, c)
                j = 8 * k
                store8(out, base + c, (x[j] - mc) * sc * w0 + b0, (x[j + 1] - mc) * sc * w1 + b1,
                       (x[j + 2] - mc) * sc * w2 + b2, (x[j + 3] - mc) * sc * w3 + b3,
                       (x[j + 4] - mc) * sc * w4 + b4, (x[j + 5] - mc) * sc * w5 + b5,
                       (x[j + 6] - mc) * sc * w6 + b6, (x[j + 7] - mc) * sc * w7 + b7)
        # cache for backward
        if lane == 0:
            mean[row] = m
            rstd[row] = s
    return layernorm_forward_units_kernel


@functools.cache
def backward_kernel(C: int):
    """The backward kernel for rows of C channels (C % 8 == 0): team_warps(C) warps a block."""
    U = C // UNIT
    TW = team_warps(C)
    TPB = TW * WARP                 # threads of a team
    NV = VPT * UNIT

    @cuda.jit
    def layernorm_backward_units_kernel(dinp, partial, dout, inp, weight, mean, rstd):
        # dinp, dout, inp: (N*C,) flat; weight: (C,); mean, rstd: (N,); partial: (G*2C,) float32 flat, G =
        # gridDim.x teams. Team g takes rows g, g+G, ...; accumulates (+=) into dinp and overwrites team g's
        # partial row: its rows' sums of norm * dout (channels 0..C-1), then of dout (C..2C-1).
        N = mean.shape[0]
        t = cuda.threadIdx.x
        warp, lane = t // WARP, t & (WARP - 1)
        sums = cuda.shared.array((2, 2, TW), numba.float64)     # [row parity][sum][warp]
        # this thread's weights, once; its sums start at 0
        w = cuda.local.array(NV, numba.float32)
        dw = cuda.local.array(NV, numba.float32)
        db = cuda.local.array(NV, numba.float32)
        for k in range(VPT):
            c = UNIT * min(t + TPB * k, U - 1)
            w[8 * k], w[8 * k + 1], w[8 * k + 2], w[8 * k + 3], w[8 * k + 4], w[8 * k + 5], w[8 * k + 6], \
                w[8 * k + 7] = load8(weight, c)
            for j in range(UNIT):
                dw[8 * k + j] = 0.0
                db[8 * k + j] = 0.0
        parity = 0
        x = cuda.local.array(NV, numba.float32)         # the row's inp (then its norm), dout, dinp
        g = cuda.local.array(NV, numba.float32)
        d = cuda.local.array(NV, numba.float32)
        for row in range(cuda.blockIdx.x, N, cuda.gridDim.x):
            base = row * C
            # the row's units of inp, dout and dinp, all loads first (past the last unit: unit U-1, unused)
            for k in range(VPT):
                e = base + UNIT * min(t + TPB * k, U - 1)
                j = 8 * k
                x[j], x[j + 1], x[j + 2], x[j + 3], x[j + 4], x[j + 5], x[j + 6], x[j + 7] = load8(inp, e)
                g[j], g[j + 1], g[j + 2], g[j + 3], g[j + 4], g[j + 5], g[j + 6], g[j + 7] = load8(dout, e)
                d[j], d[j + 1], d[j + 2], d[j + 3], d[j + 4], d[j + 5], d[j + 6], d[j + 7] = load8(dinp, e)
            m = numba.float32(mean[row])
            s = numba.float32(rstd[row])
            loads_barrier()
            # x becomes norm, g stays dout; the thread's sums of dnorm = weight * dout and of dnorm * norm
            acc_d = numba.float32(0.0)
            acc_dn = numba.float32(0.0)
            for k in range(VPT):
                if t + TPB * k < U:
                    for j in range(8 * k, 8 * k + UNIT):
                        x[j] = (x[j] - m) * s
                        dnorm = w[j] * g[j]
                        acc_d += dnorm
                        acc_dn += dnorm * x[j]
            # the team's sums: each warp's butterfly, then the warps in order (sums[parity]: a warp that
            # runs ahead to the next row writes the other half, so one barrier a row suffices)
            acc_d64 = warp_sum(numba.float64(acc_d))
            acc_dn64 = warp_sum(numba.float64(acc_dn))
            if lane == 0:
                sums[parity, 0, warp] = acc_d64
                sums[parity, 1, warp] = acc_dn64
            cuda.syncthreads()
            tot_d = numba.float64(0.0)
            tot_dn = numba.float64(0.0)
            for v in range(TW):
                tot_d += sums[parity, 0, v]
                tot_dn += sums[parity, 1, v]
            dnorm_mean = numba.float32(tot_d / C)
            dnorm_norm_mean = numba.float32(tot_dn / C)
            parity = 1 - parity
            # dinp += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)); the parameter sums
            for k in range(VPT):
                u = t + TPB * k
                if u < U:
                    j = 8 * k
                    store8(dinp, base + UNIT * u,
                           d[j] + s * (w[j] * g[j] - dnorm_mean - x[j] * dnorm_norm_mean),
                           d[j + 1] + s * (w[j + 1] * g[j + 1] - dnorm_mean - x[j + 1] * dnorm_norm_mean),
                           d[j + 2] + s * (w[j + 2] * g[j + 2] - dnorm_mean - x[j + 2] * dnorm_norm_mean),
                           d[j + 3] + s * (w[j + 3] * g[j + 3] - dnorm_mean - x[j + 3] * dnorm_norm_mean),
                           d[j + 4] + s * (w[j + 4] * g[j + 4] - dnorm_mean - x[j + 4] * dnorm_norm_mean),
                           d[j + 5] + s * (w[j + 5] * g[j + 5] - dnorm_mean - x[j + 5] * dnorm_norm_mean),
                           d[j + 6] + s * (w[j + 6] * g[j + 6] - dnorm_mean - x[j + 6] * dnorm_norm_mean),
                           d[j + 7] + s * (w[j + 7] * g[j + 7] - dnorm_mean - x[j + 7] * dnorm_norm_mean))
                    for i in range(j, j + UNIT):
                        dw[i] += x[i] * g[i]
                        db[i] += g[i]
        # the team's partial row
        prow = cuda.blockIdx.x * 2 * C
        for k in range(VPT):
            u = t + TPB * k
            if u < U:
                j = 8 * k
                store8(partial, prow + UNIT * u, dw[j], dw[j + 1], dw[j + 2], dw[j + 3], dw[j + 4], dw[j + 5],
                       dw[j + 6], dw[j + 7])
                store8(partial, prow + C + UNIT * u, db[j], db[j + 1], db[j + 2], db[j + 3], db[j + 4],
                       db[j + 5], db[j + 6], db[j + 7])
    return layernorm_backward_units_kernel


def units_apply(C: int, *xs) -> bool:
    """The unit kernels apply: C % 8 == 0 and every value array float32 or bf16, contiguous, on 16 bytes."""
    return C % UNIT == 0 and units_fit(*xs)


def forward_geometry(N: int) -> tuple[int, int]:
    """(grid, block) of the forward: WARPS_PER_BLOCK rows (warps) a block."""
    return ceil_div(N, WARPS_PER_BLOCK), WARPS_PER_BLOCK * WARP


def layernorm_forward_units(dev, out, mean, rstd, inp, weight, bias) -> None:
    """llmz.fast.layernorm.layernorm_forward's call on units (the teaching kernel where they do not fit)."""
    C = inp.shape[-1]
    if not units_apply(C, out, inp, weight, bias):
        return teaching.layernorm_forward(dev, out, mean, rstd, inp, weight, bias)
    dev.launch(forward_kernel(C), *forward_geometry(inp.size // C), out.reshape(-1), mean.reshape(-1),
               rstd.reshape(-1), inp.reshape(-1), weight, bias, inp.reshape(-1), inp.reshape(-1))


def residual_layernorm_forward(dev, residual, out, mean, rstd, inp1, inp2, weight, bias) -> None:
    """residual = inp1 + inp2 (llmz.kernels.residual's forward), then out, mean, rstd = the layernorm forward of
    residual, in one kernel (one read of each input, one write of residual and of out). Shapes as
    layernorm_forward's; residual, inp1, inp2 alike. Overwrites residual, out, mean, rstd."""
    C = inp1.shape[-1]
    if not units_apply(C, residual, out, inp1, inp2, weight, bias):
        teaching_residual.residual_forward(dev, residual, inp1, inp2)
        return teaching.layernorm_forward(dev, out, mean, rstd, residual, weight, bias)
    dev.launch(forward_kernel(C, 1), *forward_geometry(inp1.size // C), out.reshape(-1), mean.reshape(-1),
               rstd.reshape(-1), inp1.reshape(-1), weight, bias, residual.reshape(-1), inp2.reshape(-1))


def layernorm_backward_units(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """llmz.fast.layernorm.layernorm_backward's call on units (the teaching kernels where they do not
    fit)."""
    C = inp.shape[-1]
    N = inp.size // C
    if not units_apply(C, dinp, dout, inp, weight):
        return teaching.layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    G = backward_teams(N, C)
    partial = dev.scratch("layernorm_params", (G, 2 * C), np.float32)
    dev.launch(backward_kernel(C), G, team_warps(C) * WARP, dinp.reshape(-1), partial.reshape(-1),
               dout.reshape(-1), inp.reshape(-1), weight, mean.reshape(-1), rstd.reshape(-1))
    # dweight += the teams' first halves summed, dbias += their second halves
    column_sum_into(dev, dweight, dbias, partial)


# ---- the versions of each case --------------------------------------------------------------------------
def forward_with(fn):
    return lambda dev, d: fn(dev, d["out"], d["mean"], d["rstd"], d["inp"], d["weight"], d["bias"])


def backward_with(fn):
    return lambda dev, d: fn(dev, d["dinp"], d["dweight"], d["dbias"], d["dout"], d["inp"], d["weight"], d["mean"],
                             d["rstd"])


def residual_two_kernels(residual_fn, layernorm_fn):
    def call(dev, d):
        residual_fn(dev, d["residual"], d["inp"], d["inp2"])
        layernorm_fn(dev, d["out"], d["mean"], d["rstd"], d["residual"], d["weight"], d["bias"])
    return call


def fused(dev, d):
    residual_layernorm_forward(dev, d["residual"], d["out"], d["mean"], d["rstd"], d["inp"], d["inp2"], d["weight"],
                               d["bias"])


CASES = {
    "forward": {1: forward_with(teaching.layernorm_forward), 2: forward_with(fast.layernorm_forward),
                3: forward_with(layernorm_forward_units)},
    "backward": {1: backward_with(teaching.layernorm_backward), 2: backward_with(fast.layernorm_backward),
                 3: backward_with(layernorm_backward_units)},
    "residual + forward": {1: residual_two_kernels(teaching_residual.residual_forward, teaching.layernorm_forward),
                           2: residual_two_kernels(fast_residual.residual_forward, fast.layernorm_forward),
                           3: residual_two_kernels(residual_forward_units, layernorm_forward_units),
                           4: fused},
}
NAMES = {1: "teaching", 2: "warp a row, 2-byte loads (fast set)", 3: "units, per-C kernels (candidate)",
         4: "residual fused (candidate)"}
VERSIONS = harness.case_versions(NAMES, CASES)


def inputs(N, C, case):
    import cupy as cp
    d = {"inp": harness.rand((N, C)), "weight": harness.rand(C, 0.5), "bias": harness.rand(C, 0.5),
         "out": cp.zeros((N, C), cp.uint16), "mean": cp.zeros(N, cp.float32), "rstd": cp.zeros(N, cp.float32)}
    if case == "backward":
        x = harness.f64(d["inp"])
        m = x.mean(axis=1)
        d["mean"] = m.astype(cp.float32)
        d["rstd"] = (1.0 / cp.sqrt(((x - m[:, None]) ** 2).mean(axis=1) + LN_EPS)).astype(cp.float32)
        d.update(dout=harness.rand((N, C)), dinp=harness.rand((N, C)), dweight=harness.rand(C),
                 dbias=harness.rand(C))
    if case == "residual + forward":
        d.update(inp2=harness.rand((N, C)), residual=cp.zeros((N, C), cp.uint16))
    return d


def reference(case):
    def ref(d):
        import cupy as cp
        f = {k: harness.f64(v) for k, v in d.items()}
        if case == "backward":
            want = {"dinp": f["dinp"].copy(), "dweight": f["dweight"].copy(), "dbias": f["dbias"].copy()}
            layernorm_backward_ref(want["dinp"], want["dweight"], want["dbias"], f["dout"], f["inp"], f["weight"],
                                   f["mean"], f["rstd"])
            return want
        x = f["inp"]
        want = {}
        if case == "residual + forward":
            want["residual"] = harness.f64(harness.to_bf16((x + f["inp2"]).astype(cp.float32)))
            x = want["residual"]
        out, mean, rstd = cp.empty_like(x), cp.empty(x.shape[0]), cp.empty(x.shape[0])
        layernorm_forward_ref(out, mean, rstd, x, f["weight"], f["bias"])
        want.update(out=out, mean=mean, rstd=rstd)
        return want
    return ref


def cases(cfg, B):
    C, N = cfg.channels, B * harness.T
    row = N * C * 2
    traffic = {"forward": 2 * row + 8 * N, "backward": 4 * row + 8 * N, "residual + forward": 4 * row + 8 * N}
    outputs = {"forward": ("out", "mean", "rstd"), "backward": (),
               "residual + forward": ("out", "mean", "rstd", "residual")}
    for case, versions in CASES.items():
        yield (case, lambda case=case: inputs(N, C, case), outputs[case], reference(case), traffic[case],
               harness.BF16_TOL, lambda v, versions=versions: v in versions)


if __name__ == "__main__":
    sys.exit(harness.run("layernorm", __doc__, VERSIONS, cases, sys.argv[1:]))
