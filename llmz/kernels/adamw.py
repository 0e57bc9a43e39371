"""AdamW as llm.c does it (bias correction, decoupled weight decay), on one flat 1-D slice of parameters:

    g = grad * grad_scale                       (grad_scale: the clipping factor, 1.0 when not clipping)
    m = beta1 m + (1 - beta1) g                 v = beta2 v + (1 - beta2) g^2
    m_hat = m / (1 - beta1^t)                   v_hat = v / (1 - beta2^t)
    p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p),   wd = weight_decay for i < decay_size, 0 after

The numbers that change from step to step (lr, grad_scale, the two bias corrections) come from a small
float64 device array, `scalars` = [lr, grad_scale, 1 - beta1^t, 1 - beta2^t, step], not from Python floats: a
kernel launch then never changes between steps, so the whole step can be captured once as a CUDA graph and
replayed (the clipping factor is even computed on the device, by norm.clip_scale). beta1, beta2, eps and
weight_decay are fixed for a run and stay plain arguments.

bf16 training (`adamw_update_bf16`): the parameters the model reads are bf16 (uint16 bit patterns), the
gradients too; the optimizer keeps an fp32 master copy of the parameters besides m and v, updates the
master with the same formula, and writes the bf16 parameter by rounding the new master stochastically (llm.c's
adamw_kernel3), so updates smaller than half a bf16 ulp still move the bf16 weights in expectation. Both
kernels call one device function, `adamw_element`, so the formula exists once on the device; the bf16
reference calls the fp32 reference in float64. The simulator computes exactly as the reference (Python floats
are IEEE doubles); on the GPU, NVVM contracts a*b + c into fused multiply-adds (its default), which can move
the last bit of a float64 and so, rarely, one float32 ulp of a stored value. The stochastic rounding's step
is scalars[4] (the optimizer step, 0-based; a float64 holds it exactly), read on the device like the learning
rate, so a replayed CUDA graph draws fresh bits every step; `seed` is fixed for a run and a launch argument.

On the GPU, when n is even and every array starts on a word boundary, the bf16 update goes through
adamw_bf16_pairs_kernel: words of two neighbouring elements (llmz.kernels.bf16's pair_view words, as in
llmz.kernels.gelu's paired kernels), a 4-byte load per bf16 pair and an 8-byte load per float32 pair, four
words per thread with all loads issued before the math (78 registers on sm_90, no spills). Each element keeps
its own weight decay (a word may straddle decay_size) and its own random word (hash index offset + element),
so each element's arithmetic is adamw_bf16_kernel's. Before (one element per thread, 2-byte bf16 loads; bf16 d12,
124.5M parameters, on an H200 of about 4.8 TB/s): 1.40 ms per step, about 1.4 TB/s; after: 1.38 ms (bound by
the float64 update, not the loads). On the H200 params and master are the scalar kernel's bits; m and v
differ by one float32 ulp on ~0.1% of elements (the compiler contracts the float64 update into FMAs per
kernel; see tests/test_bf16.py assert_same_update). Odd sizes, views at an
odd element and the simulator's layer path take the scalar kernel (tests launch the paired one directly).
"""
import math

import numpy as np
from numba import cuda

from ..bf16 import M32, bf16_to_f32, f32_to_bf16, f32_to_bf16_stochastic
from ..device import ceil_div
from .bf16 import S16, bf16_to_f32_dev, hash_args, round_bf16, store_pair
from .gelu import elementwise_blocks, four_pairs, four_slots, loads_barrier, pairs_apply, words


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


# ---- Numba kernel: four words of two elements per thread (bf16 on the GPU) -----------------------
# The arrays are pair_view words (llmz.kernels.bf16): params and grads as uint32 (two bf16), master, m and v
# as uint64 (two float32); word w holds elements 2w and 2w+1. Thread i takes words i, i+S, i+2S, i+3S
# (S = the threads of the grid), as llmz.kernels.gelu's paired kernels do.
@cuda.jit(device=True)
def adamw_bf16_word(params, master, m, v, w, g0, g1, p0, p1, m0, m1, v0, v1, decay_size, lr, grad_scale, bc1,
                    bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step):
    """Word w of the paired views: elements e0 = 2w and e1 = 2w + 1, loaded as (g, p, m, v) 0 and 1. Each
    element computes as in adamw_bf16_kernel (its own weight decay, its own hash index offset + e). Overwrites
    word w of params, master, m and v."""
    e0 = 2 * w
    e1 = e0 + 1
    # weight decay per element: a word may straddle decay_size
    wd0 = weight_decay if e0 < decay_size else 0.0
    wd1 = weight_decay if e1 < decay_size else 0.0
    # the fp32 master update, element by element, on the scaled (clipped) gradients
    q0, n0, u0 = adamw_element(p0, float(g0) * grad_scale, m0, v0, lr, bc1, bc2, beta1, beta2, eps, wd0)
    q1, n1, u1 = adamw_element(p1, float(g1) * grad_scale, m1, v1, lr, bc1, bc2, beta1, beta2, eps, wd1)
    store_pair(m, w, n0, n1)
    store_pair(v, w, u0, u1)
    r0, r1 = np.float32(q0), np.float32(q1)
    store_pair(master, w, r0, r1)
    # the bf16 parameters: each rounded with its own element's random word, packed low half first
    b0 = round_bf16(r0, stochastic, seed, offset + np.uint64(e0), step)
    b1 = round_bf16(r1, stochastic, seed, offset + np.uint64(e1), step)
    params[w] = np.uint32(np.uint64(b0) | (np.uint64(b1) << S16))


@cuda.jit
def adamw_bf16_pairs_kernel(params, master, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay,
                            stochastic, seed, offset, n_words):
    """params, grads: (n_words,) uint32 words of two bf16; master, m, v: (n_words,) uint64 words of two
    float32 (2 n_words elements); scalars as in adamw_bf16_kernel. Overwrites all but grads, with the same
    bits as adamw_bf16_kernel."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n_words)
    # the loads first: the step's scalars, then four words each of grads, master, m and v (params only stored)
    lr, grad_scale, bc1, bc2, s4 = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4]
    g0, g1, g2, g3, g4, g5, g6, g7 = four_pairs(grads, j0, j1, j2, j3)
    p0, p1, p2, p3, p4, p5, p6, p7 = four_pairs(master, j0, j1, j2, j3)
    m0, m1, m2, m3, m4, m5, m6, m7 = four_pairs(m, j0, j1, j2, j3)
    v0, v1, v2, v3, v4, v5, v6, v7 = four_pairs(v, j0, j1, j2, j3)
    loads_barrier()
    # the rounding's step (device memory: a replayed CUDA graph draws fresh bits)
    step = np.uint64(s4) & M32
    # the update, the words inside the array
    if i0 < n_words:
        adamw_bf16_word(params, master, m, v, i0, g0, g1, p0, p1, m0, m1, v0, v1, decay_size, lr, grad_scale,
                        bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)
    if i1 < n_words:
        adamw_bf16_word(params, master, m, v, i1, g2, g3, p2, p3, m2, m3, v2, v3, decay_size, lr, grad_scale,
                        bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)
    if i2 < n_words:
        adamw_bf16_word(params, master, m, v, i2, g4, g5, p4, p5, m4, m5, v4, v5, decay_size, lr, grad_scale,
                        bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)
    if i3 < n_words:
        adamw_bf16_word(params, master, m, v, i3, g6, g7, p6, p7, m6, m7, v6, v7, decay_size, lr, grad_scale,
                        bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def adamw_update(dev, params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay):
    """params, grads, m, v: (n,); scalars: float64 device array [lr, grad_scale, 1-beta1^t, 1-beta2^t].
    Overwrites params, m and v."""
    if not dev.kernels:
        return adamw_update_ref(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay)
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
    if not dev.kernels:
        return adamw_update_bf16_ref(params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1, beta2,
                                     eps, weight_decay, seed, stochastic, offset)
    n = params_u16.size
    seed_u64, _, offset_u64 = hash_args(seed, 0, offset)          # the step comes from scalars[4]
    if pairs_apply(dev, params_u16, master_f32, grads_u16, m, v):
        # on the GPU, n even and every array on a word boundary: two elements per load and store
        dev.launch(adamw_bf16_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
                   words(params_u16), words(master_f32), words(grads_u16), words(m), words(v), int(decay_size),
                   scalars, float(beta1), float(beta2), float(eps), float(weight_decay), bool(stochastic),
                   seed_u64, offset_u64, n // 2)
        return
    dev.launch(adamw_bf16_kernel, ceil_div(n, dev.block_size), dev.block_size,
               params_u16, master_f32, grads_u16, m, v, int(decay_size), scalars,
               float(beta1), float(beta2), float(eps), float(weight_decay), bool(stochastic),
               seed_u64, offset_u64, n)
