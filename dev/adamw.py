"""AdamW for bf16 training, version by version (llm.c's dev/cuda role): one update of every parameter of
d12..d48 (bf16 params and grads, fp32 master, m, v), each version checked against the float64 reference on
fresh random inputs and timed, a table last (dev/harness.py). Bytes: 28 an element (grads 2 read, params 2
written, master, m, v 4 read + 4 written each).

    python dev/adamw.py [--model d48] [VERSION ...]

version 1: teaching (llmz.kernels.adamw): a thread an element, float64 update
version 2: fast set (llmz.fast.adamw): words of two, four a thread, float64 update (d48: 16.3 ms a step, 62%)
version 3: a unit of 8 a thread, float32 update (llm.c's); predicts d48 11.9 ms (85%); not yet run on a GPU
Sizes: every parameter of d12, the first 200M of the larger models.
"""
import math
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.vectors import UNIT, load8_into, pack_bf16x2_bits, store8_from, store16, units_fit
from llmz.bf16 import M32
from llmz.fast import adamw as fast
from llmz.fast.device_helpers import loads_barrier
from llmz.kernels import adamw as teaching
from llmz.kernels.bf16 import hash_args, round_bf16


# ---- version 3: a unit of 8 elements a thread, the update in float32 --------------------------------------
# m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2 (g = grad * grad_scale),
# master -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd master), with 1 / bc1 and 1 / bc2 once a thread (from
# the float64 device scalars). Each element keeps its own weight decay (a unit may straddle decay_size) and its
# own random word (hash index offset + element) for the stochastic rounding, as the teaching kernel draws it.
# Contract: master, m and v within a few float32 ulps of the float64 reference; params the teaching rounding
# of this master (the same random word per element).
@cuda.jit(device=True)
def adamw_element32(p, g, m, v, lr, beta1, beta2, one_m_beta1, one_m_beta2, rbc1, rbc2, eps, wd):
    """One element's update in float32 (g the scaled gradient, wd this element's weight decay, rbc1 and rbc2
    the reciprocal bias corrections). Returns (p, m, v)."""
    m = beta1 * m + one_m_beta1 * g
    v = beta2 * v + one_m_beta2 * (g * g)
    return p - lr * ((m * rbc1) / (np.float32(math.sqrt(v * rbc2)) + eps) + wd * p), m, v


@cuda.jit
def adamw_bf16_units_kernel(params, master, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay,
                            stochastic, seed, offset, n_units):
    """params, grads: (8 n_units,) bf16 bits; master, m, v: (8 n_units,) float32; scalars (5,) float64 [lr,
    grad_scale, 1 - beta1^t, 1 - beta2^t, step]. Overwrites all but grads."""
    i = cuda.grid(1)
    e = UNIT * min(i, n_units - 1)
    g = cuda.local.array(UNIT, np.float32)
    p = cuda.local.array(UNIT, np.float32)
    mm = cuda.local.array(UNIT, np.float32)
    vv = cuda.local.array(UNIT, np.float32)
    # the loads first: the step's scalars, then the unit of grads, master, m and v
    lr, grad_scale, bc1, bc2, s4 = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    load8_into(g, 0, grads, e)
    load8_into(p, 0, master, e)
    load8_into(mm, 0, m, e)
    load8_into(vv, 0, v, e)
    loads_barrier()
    if i >= n_units:
        return
    # the step's constants in float32
    lr32, gs, rbc1, rbc2 = np.float32(lr), np.float32(grad_scale), np.float32(1.0 / bc1), np.float32(1.0 / bc2)
    b1, b2, eps32, wd32 = np.float32(beta1), np.float32(beta2), np.float32(eps), np.float32(weight_decay)
    omb1, omb2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)     # from float64: 1 - float32(0.95) is 2e-7 off
    step = np.uint64(s4) & M32
    bits = cuda.local.array(UNIT, np.uint32)
    for k in range(UNIT):
        wd = wd32 if e + k < decay_size else np.float32(0.0)
        p[k], mm[k], vv[k] = adamw_element32(p[k], g[k] * gs, mm[k], vv[k], lr32, b1, b2, omb1, omb2, rbc1,
                                             rbc2, eps32, wd)
        bits[k] = round_bf16(p[k], stochastic, seed, offset + np.uint64(e + k), step)
    store8_from(master, e, p, 0)
    store8_from(m, e, mm, 0)
    store8_from(v, e, vv, 0)
    store16(params, e, pack_bf16x2_bits(bits[0], bits[1]), pack_bf16x2_bits(bits[2], bits[3]),
            pack_bf16x2_bits(bits[4], bits[5]), pack_bf16x2_bits(bits[6], bits[7]))


def adamw_update_bf16_units(dev, params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1, beta2, eps,
                            weight_decay, seed, stochastic=True, offset=0) -> None:
    """llmz.fast.adamw.adamw_update_bf16's call (the same arguments) on units where units_fit, else the
    teaching kernel."""
    n = params_u16.size
    if n == 0 or not units_fit(params_u16, master_f32, grads_u16, m, v):
        return teaching.adamw_update_bf16(dev, params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1,
                                          beta2, eps, weight_decay, seed, stochastic, offset)
    seed_u64, _, offset_u64 = hash_args(seed, 0, offset)          # the step comes from scalars[4]
    n_units = n // UNIT
    dev.launch(adamw_bf16_units_kernel, -(-n_units // dev.block_size), dev.block_size,
               params_u16.reshape(-1), master_f32.reshape(-1), grads_u16.reshape(-1), m.reshape(-1), v.reshape(-1),
               int(decay_size), scalars, float(beta1), float(beta2), float(eps), float(weight_decay),
               bool(stochastic), seed_u64, offset_u64, n_units)


# ---- the versions -----------------------------------------------------------------------------------------
BETA1, BETA2, EPS, WD, SEED = 0.9, 0.95, 1e-8, 0.1, 1234


def with_fn(fn):
    def call(dev, d, case=None):
        fn(dev, d["params"], d["master"], d["grads"], d["m"], d["v"], d["decay"].size, d["scalars"], BETA1,
           BETA2, EPS, WD, SEED)
    return call


VERSIONS = {1: ("teaching, float64", with_fn(teaching.adamw_update_bf16)),
            2: ("words of two, float64 (fast set)", with_fn(fast.adamw_update_bf16)),
            3: ("units of 8, float32 (candidate)", with_fn(adamw_update_bf16_units))}


MAX_ELEMENTS = 200_000_000     # d24 and up: the first 200M parameters (the rate does not depend on n by then;
#                                the whole of d48 with its float64 reference would need ~100 GB)


def cases(cfg, B):
    import cupy as cp
    n = min(cfg.num_parameters(), MAX_ELEMENTS) // 8 * 8
    decay = n // 2

    def make():
        master = harness.rand(n, 0.02, "f32")
        return {"params": harness.to_bf16(master), "master": master, "grads": harness.rand(n, 0.01),
                "m": harness.rand(n, 1e-3, "f32"), "v": cp.abs(harness.rand(n, 1e-5, "f32")) + np.float32(1e-7),
                "scalars": cp.asarray(np.array([3e-4, 0.7, 1 - BETA1 ** 5, 1 - BETA2 ** 5, 5.0])),
                "decay": cp.empty(decay, cp.uint8)}

    def reference(d):
        p, m, v = harness.f64(d["master"]), harness.f64(d["m"]), harness.f64(d["v"])
        teaching.adamw_update_ref(p, harness.f64(d["grads"]), m, v, decay, harness.host(d["scalars"]), BETA1,
                                  BETA2, EPS, WD)
        return {"master": p, "m": m, "v": v, "params": p}
    yield f"update {n / 1e6:.0f}M", make, (), reference, 28 * n, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("adamw", __doc__, VERSIONS, cases, sys.argv[1:]))
