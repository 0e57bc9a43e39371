"""AdamW's fast kernel. The math, shapes and dtypes are llmz/kernels/adamw.py's.

adamw_bf16_pairs_kernel replaces the teaching adamw_bf16_kernel (one thread per element) when n is even and
every array starts on a word boundary: words of two neighbouring elements (llmz.fast.device_helpers: a 4-byte
load per bf16 pair, an 8-byte load per float32 pair), four words per thread, all loads issued before the math.
Each element keeps its own weight decay (a word may straddle decay_size) and its own random word (hash index
offset + element), so each element's arithmetic is the teaching kernel's. fp32 training's adamw_update has no
fast version (llmz.fast re-exports the teaching one).
Contract: params and master the teaching kernel's bits; m and v the same up to one float32 ulp on a small
share of elements on the GPU (the compiler contracts the float64 update into fused multiply-adds per kernel,
and where the float64 value lies on a float32 rounding tie the two kernels may round apart; in the simulator,
which does not contract, the same bits).
"""
import numpy as np
from numba import cuda

from ..bf16 import M32
from ..kernels import adamw as teaching
from ..kernels.adamw import adamw_element
from ..kernels.bf16 import S16, hash_args, round_bf16
from .device_helpers import (
    elementwise_blocks,
    four_pairs,
    four_slots,
    loads_barrier,
    pairs_apply,
    store_pair,
    words,
)


# ---- Numba kernel: four words of two elements per thread --------------------------------------------
# The arrays are pair_view words: params and grads as uint32 (two bf16), master, m and v as uint64 (two
# float32); word w holds elements 2w and 2w+1. Thread i takes words i, i+S, i+2S, i+3S (S = the threads of
# the grid), as llmz.fast.gelu's paired kernels do.
@cuda.jit(device=True)
def adamw_bf16_word(params, master, m, v, n_words, w, g0, g1, p0, p1, m0, m1, v0, v1, decay_size, lr, grad_scale,
                    bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step):
    """Word w of the paired views, if w < n_words (else nothing): elements e0 = 2w and e1 = 2w + 1, loaded as
    (g, p, m, v) 0 and 1. Each element computes as in adamw_bf16_kernel (its own weight decay, its own hash
    index offset + e). Overwrites word w of params, master, m and v."""
    if w >= n_words:
        return
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
    adamw_bf16_word(params, master, m, v, n_words, i0, g0, g1, p0, p1, m0, m1, v0, v1, decay_size, lr, grad_scale,
                    bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)
    adamw_bf16_word(params, master, m, v, n_words, i1, g2, g3, p2, p3, m2, m3, v2, v3, decay_size, lr, grad_scale,
                    bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)
    adamw_bf16_word(params, master, m, v, n_words, i2, g4, g5, p4, p5, m4, m5, v4, v5, decay_size, lr, grad_scale,
                    bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)
    adamw_bf16_word(params, master, m, v, n_words, i3, g6, g7, p6, p7, m6, m7, v6, v7, decay_size, lr, grad_scale,
                    bc1, bc2, beta1, beta2, eps, weight_decay, stochastic, seed, offset, step)


# ---- the layer ---------------------------------------------------------------------------------
def adamw_update_bf16(dev, params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1, beta2, eps,
                      weight_decay, seed, stochastic=True, offset=0) -> None:
    """As llmz.kernels.adamw.adamw_update_bf16 (the arguments, the hash index offset): overwrites params,
    master, m and v; the paired kernel where pairs_apply, else the teaching kernel."""
    n = params_u16.size
    if not pairs_apply(params_u16, master_f32, grads_u16, m, v):
        return teaching.adamw_update_bf16(dev, params_u16, master_f32, grads_u16, m, v, decay_size, scalars, beta1,
                                          beta2, eps, weight_decay, seed, stochastic, offset)
    seed_u64, _, offset_u64 = hash_args(seed, 0, offset)          # the step comes from scalars[4]
    dev.launch(adamw_bf16_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               words(params_u16), words(master_f32), words(grads_u16), words(m), words(v), int(decay_size),
               scalars, float(beta1), float(beta2), float(eps), float(weight_decay), bool(stochastic),
               seed_u64, offset_u64, n // 2)
