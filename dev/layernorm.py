"""LayerNorm, version by version (llm.c's dev/cuda role): forward, backward (dinp, dweight, dbias) and the
residual add fused into the forward, each version checked against the float64 reference on fresh random
bf16 inputs and timed at d12..d48 (B*T rows of C channels), a table last (dev/harness.py).

    python dev/layernorm.py [--model d48] [-b 8] [VERSION ...]

version 1: the teaching kernels (llmz.kernels.layernorm): a block per row, float64 per element; dweight and
           dbias one thread per channel over all rows
version 2: a warp per row, the row in registers as 2-byte loads (C <= 1024: 32 slots a lane) or three strided
           passes (C > 1024, float64 sums: at d48 10% of the bandwidth); dweight/dbias a second kernel over
           the rows (column_sum's two stages, 8 rows in flight: 4% at d48, 2-byte loads of 32-column strips)
version 3: llmz.fast.layernorm: kernels built per C, rows in registers as 16-byte units at every width; the
           backward one pass (dinp, and dweight/dbias partial sums per team of warps, then a column sum)
version 4: (the residual case) residual add and layernorm forward in one kernel (llm.c's
           fused_residual_forward5), against version 3's two kernels
"""
import math
import os
import sys

import numba
import numpy as np
from numba import cuda, types
from numba.cuda.extending import overload

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.column_sum import COLSUM_STRIP, MAX_LANES, column_total, geometry, stage_rows, strip_partial
from llmz.device import ceil_div
from llmz.fast import layernorm as fast
from llmz.fast import residual as fast_residual
from llmz.fast.column_sum import last_in_strip
from llmz.fast.device_helpers import WARP, warp_row, warp_sum
from llmz.kernels import layernorm as teaching
from llmz.kernels import residual as teaching_residual
from llmz.kernels.bf16 import load, store, store_add
from llmz.kernels.layernorm import LN_EPS, layernorm_backward_ref, layernorm_forward_ref

# version 2's constants
MAX_PER_LANE = 32
WARPS_PER_BLOCK = 4
ROWS_IN_FLIGHT = 8


# ---- version 2's kernels --------------------------------------------------------------------------------
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


@cuda.jit
def layernorm_backward_inp_warp_kernel(dinp, dout, inp, weight, mean, rstd):
    """dinp, dout, inp: (N,C), C <= 32 * MAX_PER_LANE; weight: (C,); mean, rstd: (N,). One warp per row, the
    rows of inp, dout and dinp in registers as in the forward. Accumulates (+=) into dinp."""
    N, C = inp.shape
    row, lane = warp_row()
    if row >= N:
        return
    x_row = inp[row]
    g_row = dout[row]
    dx_row = dinp[row]
    # read the three rows once, every load issued before any arithmetic
    x = cuda.local.array(MAX_PER_LANE, inp.dtype)
    g = cuda.local.array(MAX_PER_LANE, dout.dtype)
    dx = cuda.local.array(MAX_PER_LANE, dinp.dtype)
    for k in range(MAX_PER_LANE):
        i = lane + k * WARP
        if i < C:
            x[k] = x_row[i]
            g[k] = g_row[i]
            dx[k] = dx_row[i]
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
    m = mean[row]
    s = rstd[row]
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


def v2_forward(dev, out, mean, rstd, inp, weight, bias):
    N, C = inp.shape
    kernel = layernorm_forward_warp_kernel if C <= WARP * MAX_PER_LANE else layernorm_forward_warp_loop_kernel
    dev.launch(kernel, ceil_div(N, WARPS_PER_BLOCK), WARPS_PER_BLOCK * WARP, out, mean, rstd, inp, weight, bias)


def v2_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    N, C = inp.shape
    kernel = layernorm_backward_inp_warp_kernel if C <= WARP * MAX_PER_LANE else \
        layernorm_backward_inp_warp_loop_kernel
    dev.launch(kernel, ceil_div(N, WARPS_PER_BLOCK), WARPS_PER_BLOCK * WARP, dinp, dout, inp, weight, mean, rstd)
    grid, block, R, rows = geometry(N, C, False)
    part_w = dev.scratch("dev_ln_dweight", (R, C), np.float64)
    part_b = dev.scratch("dev_ln_dbias", (R, C), np.float64)
    counters = dev.scratch("dev_ln_count", grid[0], np.int32)
    dev.launch(layernorm_backward_params_kernel, grid, block, dweight, dbias, part_w, part_b, counters, dout, inp,
               mean, rstd, rows)


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
    fast.residual_layernorm_forward(dev, d["residual"], d["out"], d["mean"], d["rstd"], d["inp"], d["inp2"],
                                    d["weight"], d["bias"])


CASES = {
    "forward": {1: forward_with(teaching.layernorm_forward), 2: forward_with(v2_forward),
                3: forward_with(fast.layernorm_forward)},
    "backward": {1: backward_with(teaching.layernorm_backward), 2: backward_with(v2_backward),
                 3: backward_with(fast.layernorm_backward)},
    "residual + forward": {1: residual_two_kernels(teaching_residual.residual_forward, teaching.layernorm_forward),
                           3: residual_two_kernels(fast_residual.residual_forward, fast.layernorm_forward),
                           4: fused},
}
NAMES = {1: "teaching", 2: "warp a row, 2-byte loads", 3: "units, per-C kernels", 4: "residual fused"}
VERSIONS = {v: (NAMES[v], lambda dev, d, case, v=v: CASES[case][v](dev, d)) for v in NAMES}


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
