"""AdamW as llm.c does it (adamw_kernel: bias correction, decoupled weight decay), on one flat 1-D slice:

    g = grad * grad_scale                       (grad_scale: the clipping factor, 1.0 when not clipping)
    m = beta1 m + (1 - beta1) g                 v = beta2 v + (1 - beta2) g^2
    m_hat = m / (1 - beta1^t)                   v_hat = v / (1 - beta2^t)
    p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p),   wd = weight_decay for i < decay_size, 0 after

The numbers that change from step to step (lr, grad_scale, the two bias corrections, the step) come from a
float64 device array, `scalars` = [lr, grad_scale, 1 - beta1^t, 1 - beta2^t, step], not from Python floats:
a launch then never changes between steps, so the whole step can be captured once as a CUDA graph (the
clipping factor is even computed on the device, by llmz.kernels.norm.clip_scale). beta1, beta2, eps and
weight_decay are fixed for a run and plain arguments. One thread per element, the arithmetic in float64
(adamw_element, one device function for both kernels); params, m, v are overwritten.

bf16 training (adamw_update_bf16, llm.c's adamw_kernel3): params and grads are bf16 (uint16 bits); the
optimizer keeps an fp32 master copy besides m and v, updates it with the same formula and writes the bf16
parameter by rounding the new master stochastically, so updates below half a bf16 ulp still move the bf16
weights in expectation. Element i draws its random word at (seed, offset + i, step = scalars[4]), read on the
device like the learning rate, so a replayed CUDA graph draws fresh bits every step. The simulator computes
exactly as the reference (Python floats are IEEE doubles); on the GPU, NVVM contracts a*b + c into fused
multiply-adds, which can move the last bit of a float64 and so, rarely, one float32 ulp of a stored value.
"""
import math

import numpy as np
from numba import cuda

from ..bf16 import M32, bf16_to_f32, f32_to_bf16, f32_to_bf16_stochastic
from .bf16 import bf16_to_f32_dev, hash_args, round_bf16
from .grid import ceil_div


# ---- NumPy reference ----------------------------------------------------------------------------
def adamw_update_ref(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay):
    """params, grads, m, v: (n,); scalars: [lr, grad_scale, 1 - beta1^t, 1 - beta2^t].
    Overwrites params, m and v. Computes in the dtype of the arrays."""
    lr, grad_scale, bc1, bc2 = (float(s) for s in scalars[:4])
    d = decay_size
    # scaled (clipped) gradient
    g = grads * grad_scale
    # moment updates
    m[...] = beta1 * m + (1.0 - beta1) * g
    v[...] = beta2 * v + (1.0 - beta2) * (g * g)
    # bias-corrected step direction
    step = (m / bc1) / (np.sqrt(v / bc2) + eps)
    # decoupled weight decay on the first decay_size elements only
    step[:d] += weight_decay * params[:d]
    params -= lr * step


def adamw_update_bf16_ref(params, master, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay,
                          seed, stochastic=True, offset=0):
    """params, grads: (n,) uint16 bf16 bits; master, m, v: (n,) float32. Overwrites params, master, m, v.
    The update in float64 (as the kernel computes it), stored as float32; params = bf16(master), element i
    drawing its random word at hash index offset + i and step scalars[4]."""
    p, g = master.astype(np.float64), bf16_to_f32(grads).astype(np.float64)
    m64, v64 = m.astype(np.float64), v.astype(np.float64)
    # the fp32 master update: the one formula above, in float64
    adamw_update_ref(p, g, m64, v64, decay_size, scalars, beta1, beta2, eps, weight_decay)
    m[...], v[...], master[...] = m64, v64, p
    # the bf16 parameter: the new master, rounded
    step = int(scalars[4])
    params[...] = f32_to_bf16_stochastic(master, seed, step, offset) if stochastic else f32_to_bf16(master)


# ---- Numba kernels: one thread per element -------------------------------------------------------
@cuda.jit(device=True)
def adamw_element(p, g, m, v, lr, bc1, bc2, beta1, beta2, eps, wd):
    """One element's update, all in float64 (the same operations, in the same order, as adamw_update_ref).
    g is the scaled gradient; wd the weight decay of this element (0 above decay_size). Returns (p, m, v)."""
    p, g, m, v = float(p), float(g), float(m), float(v)
    # moment updates
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * (g * g)
    # bias-corrected step direction
    step = (m / bc1) / (math.sqrt(v / bc2) + eps)
    # decoupled weight decay
    return p - lr * (step + wd * p), m, v


@cuda.jit
def adamw_kernel(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay, n):
    """params, grads, m, v: (n,). Arithmetic in float64; params, m, v rounded once when stored."""
    i = cuda.grid(1)
    if i < n:
        # scaled (clipped) gradient; weight decay on the first decay_size elements only
        g = float(grads[i]) * scalars[1]
        wd = weight_decay if i < decay_size else 0.0
        p, mi, vi = adamw_element(params[i], g, m[i], v[i], scalars[0], scalars[2], scalars[3],
                                  beta1, beta2, eps, wd)
        params[i] = p
        m[i] = mi
        v[i] = vi


@cuda.jit
def adamw_bf16_kernel(params, master, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay,
                      stochastic, seed, offset, n):
    """params, grads: (n,) uint16 bf16 bits; master, m, v: (n,) float32; scalars (5,) float64, the rounding's
    step in scalars[4]. Overwrites all but grads."""
    i = cuda.grid(1)
    if i < n:
        # scaled (clipped) gradient from its bf16 bits; weight decay below decay_size
        g = float(bf16_to_f32_dev(grads[i])) * scalars[1]
        wd = weight_decay if i < decay_size else 0.0
        # the fp32 master update
        p, mi, vi = adamw_element(master[i], g, m[i], v[i], scalars[0], scalars[2], scalars[3],
                                  beta1, beta2, eps, wd)
        m[i] = mi
        v[i] = vi
        p32 = np.float32(p)
        master[i] = p32
        # the bf16 parameter: the new master, rounded (stochastically: hash index offset + i)
        step = np.uint64(scalars[4]) & M32
        params[i] = round_bf16(p32, stochastic, seed, offset + np.uint64(i), step)


# ---- the layer: the kernel's launch -------------------------------------------------------------
def adamw_update(dev, params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay):
    """params, grads, m, v: (n,); scalars: float64 device array [lr, grad_scale, 1-beta1^t, 1-beta2^t].
    Overwrites params, m and v."""
    n = params.size
    dev.launch(adamw_kernel, ceil_div(n, dev.block_size), dev.block_size,
               params, grads, m, v, int(decay_size), scalars,
               float(beta1), float(beta2), float(eps), float(weight_decay), n)


def adamw_update_bf16(dev, params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1, beta2, eps,
                      weight_decay, seed, stochastic=True, offset=0):
    """params_u16, grads_u16: (n,) bf16 bits; master_f32, m, v: (n,) float32; scalars as in adamw_update plus
    the optimizer step in scalars[4]. Updates the fp32 master, m and v, and writes params = bf16(master) rounded
    stochastically with the random word of (seed, offset + i, step) (or to nearest). Pass as `offset` the
    position of params[0] in the whole flat parameter buffer: every rank and ZeRO stage then draws the same
    bits for the same parameter. Overwrites params, master, m and v."""
    n = params_u16.size
    seed_u64, _, offset_u64 = hash_args(seed, 0, offset)          # the step comes from scalars[4]
    dev.launch(adamw_bf16_kernel, ceil_div(n, dev.block_size), dev.block_size,
               params_u16, master_f32, grads_u16, m, v, int(decay_size), scalars,
               float(beta1), float(beta2), float(eps), float(weight_decay), bool(stochastic),
               seed_u64, offset_u64, n)
