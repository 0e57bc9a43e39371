"""AdamW's fast kernel for bf16 training (llm.c's adamw_kernel3). The math, shapes and dtypes are
llmz/kernels/adamw.py's.

adamw_bf16_units_kernel replaces the teaching adamw_bf16_kernel (one thread per element, the update in
float64) when every array is a whole number of units starting on 16 bytes (units_fit; else the teaching
kernel): a thread takes one unit of 8 neighbouring elements (llmz.fast.vectors): the grads' 16 bytes, the
master's, m's and v's 32 each, all loaded before any math, then the params' 16 bytes and 32 each of master,
m, v stored: 28 bytes an element. The update in float32, as llm.c and PyTorch's fused AdamW compute it:

    m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2          (g = grad * grad_scale)
    master -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd master)

with 1 / bc1 and 1 / bc2 computed once a thread (in float64, from the device scalars). In float64 (the
teaching kernel: three divisions and a square root an element, seven float32 <-> float64 conversions) the
update cost more than the 28 bytes' time on an H200. Each element keeps its own weight decay (a unit may
straddle decay_size) and its own random word (hash index offset + element) for the stochastic rounding of
the bf16 parameter, exactly as the teaching kernel draws it. fp32 training's adamw_update has no fast version
(llmz.fast re-exports the teaching one).
Contract: master, m and v within a few float32 ulps of the float64 reference (~1e-7 relative); params the
teaching rounding of this master (the same random word per element), so equal to the teaching kernel's
wherever the masters are equal and within one bf16 step elsewhere.
"""
import math

import numpy as np
from numba import cuda

from ..bf16 import M32
from ..kernels import adamw as teaching
from ..kernels.bf16 import hash_args, round_bf16
from .device_helpers import loads_barrier
from .vectors import UNIT, load8_into, pack_bf16x2_bits, store8_from, store16, units_fit


@cuda.jit(device=True)
def adamw_element32(p, g, m, v, lr, beta1, beta2, one_m_beta1, one_m_beta2, rbc1, rbc2, eps, wd):
    """One element's update in float32 (g the scaled gradient, wd this element's weight decay, rbc1 and rbc2
    the reciprocal bias corrections). Returns (p, m, v)."""
    m = beta1 * m + one_m_beta1 * g
    v = beta2 * v + one_m_beta2 * (g * g)
    return p - lr * ((m * rbc1) / (np.float32(math.sqrt(v * rbc2)) + eps) + wd * p), m, v


# ---- Numba kernel: a unit of 8 elements a thread ----------------------------------------------------
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
        # each element its own weight decay (a unit may straddle decay_size) and its own random word
        wd = wd32 if e + k < decay_size else np.float32(0.0)
        p[k], mm[k], vv[k] = adamw_element32(p[k], g[k] * gs, mm[k], vv[k], lr32, b1, b2, omb1, omb2, rbc1,
                                             rbc2, eps32, wd)
        bits[k] = round_bf16(p[k], stochastic, seed, offset + np.uint64(e + k), step)
    store8_from(master, e, p, 0)
    store8_from(m, e, mm, 0)
    store8_from(v, e, vv, 0)
    store16(params, e, pack_bf16x2_bits(bits[0], bits[1]), pack_bf16x2_bits(bits[2], bits[3]),
            pack_bf16x2_bits(bits[4], bits[5]), pack_bf16x2_bits(bits[6], bits[7]))


# ---- the layer ---------------------------------------------------------------------------------
def adamw_update_bf16(dev, params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1, beta2, eps,
                      weight_decay, seed, stochastic=True, offset=0) -> None:
    """As llmz.kernels.adamw.adamw_update_bf16 (the arguments, the hash index offset): overwrites params,
    master, m and v; the unit kernel where units_fit, else the teaching kernel."""
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
