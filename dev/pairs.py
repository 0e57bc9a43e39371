"""Version 2 of the elementwise layers (GELU, residual, AdamW): words of two elements (a bf16 pair as one
4-byte load, a float32 pair as one 8-byte load: llmz.fast.device_helpers' pair_view), four words a grid
apart a thread, every load issued before any math. The fast kernels until the 16-byte units
(llmz.fast.vectors); kept here, runnable, for dev/gelu.py, dev/residual.py and dev/adamw.py.
"""
import numpy as np
from numba import cuda

from llmz.bf16 import M32
from llmz.device import ceil_div
from llmz.fast.device_helpers import load_pair, loads_barrier, pair_view, store_pair

ELEMS_PER_THREAD = 4        # words a thread: four slots a grid apart
from llmz.kernels.adamw import adamw_element
from llmz.kernels.bf16 import S16, hash_args, round_bf16
from llmz.kernels.gelu import gelu_grad, gelu_value


@cuda.jit(device=True)
def four_slots(n):
    """This thread's elements i0..i3 = i, i+S, i+2S, i+3S (S = the threads of the grid) and the indices j0..j3
    it loads them from: the same, or element n-1 for a slot past the end (a valid address, never stored)."""
    i0 = cuda.grid(1)
    S = cuda.gridsize(1)
    i1, i2, i3 = i0 + S, i0 + 2 * S, i0 + 3 * S
    last = n - 1
    return i0, i1, i2, i3, min(i0, last), min(i1, last), min(i2, last), min(i3, last)


@cuda.jit(device=True)
def four_pairs(a, j0, j1, j2, j3):
    """The eight elements of words j0..j3 of the paired view a (the paired kernels' four slots), as float32:
    four independent word loads."""
    x0, x1 = load_pair(a, j0)
    x2, x3 = load_pair(a, j1)
    x4, x5 = load_pair(a, j2)
    x6, x7 = load_pair(a, j3)
    return x0, x1, x2, x3, x4, x5, x6, x7


def elementwise_blocks(dev, n: int) -> int:
    """Blocks for n elements (or pair words), ELEMS_PER_THREAD per thread (0 for n = 0: nothing to launch)."""
    return ceil_div(n, ELEMS_PER_THREAD * dev.block_size)


def words(x):
    """x flattened, as pair_view words."""
    return pair_view(x.reshape(-1))


@cuda.jit(device=True)
def added(accumulate, d, v):
    """d + v when accumulating, else v (d is then a placeholder, never read from memory)."""
    return d + v if accumulate else v


@cuda.jit
def gelu_forward_pairs_kernel(out, inp, n_words):
    """out, inp: (n_words,) paired views of 2 n_words elements. Overwrites out."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n_words)
    # the four word loads first (eight elements)
    x0, x1, x2, x3, x4, x5, x6, x7 = four_pairs(inp, j0, j1, j2, j3)
    loads_barrier()
    # out = gelu(inp), the words inside the array
    if i0 < n_words:
        store_pair(out, i0, gelu_value(x0), gelu_value(x1))
    if i1 < n_words:
        store_pair(out, i1, gelu_value(x2), gelu_value(x3))
    if i2 < n_words:
        store_pair(out, i2, gelu_value(x4), gelu_value(x5))
    if i3 < n_words:
        store_pair(out, i3, gelu_value(x6), gelu_value(x7))


@cuda.jit
def gelu_backward_pairs_kernel(dinp, inp, dout, n_words, accumulate):
    """dinp, inp, dout: (n_words,) paired views. Accumulates (+=) into dinp, or overwrites it (dinp not read)
    when accumulate is False."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n_words)
    # the word loads first: inp, dout and, accumulating, the dinp added to
    x0, x1, x2, x3, x4, x5, x6, x7 = four_pairs(inp, j0, j1, j2, j3)
    g0, g1, g2, g3, g4, g5, g6, g7 = four_pairs(dout, j0, j1, j2, j3)
    d0, d1, d2, d3, d4, d5, d6, d7 = g0, g1, g2, g3, g4, g5, g6, g7      # placeholders when overwriting
    if accumulate:
        d0, d1, d2, d3, d4, d5, d6, d7 = four_pairs(dinp, j0, j1, j2, j3)
    loads_barrier()
    # dinp (+)= gelu'(inp) * dout, the words inside the array
    if i0 < n_words:
        store_pair(dinp, i0, added(accumulate, d0, gelu_grad(x0) * g0), added(accumulate, d1, gelu_grad(x1) * g1))
    if i1 < n_words:
        store_pair(dinp, i1, added(accumulate, d2, gelu_grad(x2) * g2), added(accumulate, d3, gelu_grad(x3) * g3))
    if i2 < n_words:
        store_pair(dinp, i2, added(accumulate, d4, gelu_grad(x4) * g4), added(accumulate, d5, gelu_grad(x5) * g5))
    if i3 < n_words:
        store_pair(dinp, i3, added(accumulate, d6, gelu_grad(x6) * g6), added(accumulate, d7, gelu_grad(x7) * g7))


@cuda.jit
def residual_forward_pairs_kernel(out, inp1, inp2, n_words):
    """out, inp1, inp2: (n_words,) paired views of 2 n_words elements. Overwrites out."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n_words)
    # the eight word loads first (sixteen elements)
    a0, a1, a2, a3, a4, a5, a6, a7 = four_pairs(inp1, j0, j1, j2, j3)
    b0, b1, b2, b3, b4, b5, b6, b7 = four_pairs(inp2, j0, j1, j2, j3)
    loads_barrier()
    # out = inp1 + inp2, the words inside the array
    if i0 < n_words:
        store_pair(out, i0, a0 + b0, a1 + b1)
    if i1 < n_words:
        store_pair(out, i1, a2 + b2, a3 + b3)
    if i2 < n_words:
        store_pair(out, i2, a4 + b4, a5 + b5)
    if i3 < n_words:
        store_pair(out, i3, a6 + b6, a7 + b7)


@cuda.jit(device=True)
def add_pair_twice(dinp1, dinp2, i, n_words, p0, p1, q0, q1, d0, d1):
    """Word i of dinp1 = (p0, p1) + (d0, d1) and of dinp2 = (q0, q1) + (d0, d1), where i < n_words."""
    if i < n_words:
        store_pair(dinp1, i, p0 + d0, p1 + d1)
        store_pair(dinp2, i, q0 + d0, q1 + d1)


@cuda.jit
def residual_backward_pairs_kernel(dinp1, dinp2, dout, n_words):
    """dinp1, dinp2, dout: (n_words,) paired views, dinp1 and dinp2 different arrays. Accumulates (+=) into
    dinp1 and dinp2."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n_words)
    # the twelve word loads first: dout and the two gradients being accumulated into
    d0, d1, d2, d3, d4, d5, d6, d7 = four_pairs(dout, j0, j1, j2, j3)
    p0, p1, p2, p3, p4, p5, p6, p7 = four_pairs(dinp1, j0, j1, j2, j3)
    q0, q1, q2, q3, q4, q5, q6, q7 = four_pairs(dinp2, j0, j1, j2, j3)
    loads_barrier()
    # dinp1 += dout; dinp2 += dout, the words inside the array
    add_pair_twice(dinp1, dinp2, i0, n_words, p0, p1, q0, q1, d0, d1)
    add_pair_twice(dinp1, dinp2, i1, n_words, p2, p3, q2, q3, d2, d3)
    add_pair_twice(dinp1, dinp2, i2, n_words, p4, p5, q4, q5, d4, d5)
    add_pair_twice(dinp1, dinp2, i3, n_words, p6, p7, q6, q7, d6, d7)


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



# ---- the launches ----------------------------------------------------------------------------------
def launch_pairs(dev, kernel, arrays, *extra) -> None:
    """kernel(*words of arrays, n_words, *extra), four words a thread (the arrays' size even, on a word)."""
    n = arrays[0].size // 2
    dev.launch(kernel, elementwise_blocks(dev, n), dev.block_size, *(words(x) for x in arrays), n, *extra)


def adamw_update_bf16_pairs(dev, params, master, grads, m, v, decay, scalars, beta1, beta2, eps, wd, seed):
    seed_u64, _, offset_u64 = hash_args(seed, 0, 0)
    n = params.size // 2
    dev.launch(adamw_bf16_pairs_kernel, elementwise_blocks(dev, n), dev.block_size, words(params), words(master),
               words(grads), words(m), words(v), int(decay), scalars, float(beta1), float(beta2), float(eps),
               float(wd), True, seed_u64, offset_u64, n)
