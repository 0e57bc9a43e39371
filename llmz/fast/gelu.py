"""GELU's fast kernels. The math, shapes and dtypes are llmz/kernels/gelu.py's.

gelu_forward_pairs_kernel and gelu_backward_pairs_kernel replace the teaching gelu_forward_kernel and
gelu_backward_kernel (one thread per element) for float32 and bf16 arrays of even size starting on a word
boundary: they read and write WORDS of two neighbouring elements (llmz.fast.device_helpers: a bf16 pair is
one 4-byte load, a float32 pair one 8-byte load), four words a grid apart per thread, all their loads issued
before any math or store. A warp of one-element loads moves 64 bytes of bf16 per load instruction and stays
far below the memory's rate. Other arrays (float64, odd sizes, a view at an odd element) take the teaching
kernels.
Contract: the same bits as the teaching kernels (each element's arithmetic is theirs, gelu_value / gelu_grad
in float32, rounded once at the store). gelu_backward accumulates (+=) into dinp, or overwrites it without
reading it (accumulate=False), as the teaching one does.
"""
from numba import cuda

from ..kernels.gelu import gelu_backward_kernel, gelu_forward_kernel, gelu_grad, gelu_value
from .device_helpers import four_pairs, four_slots, launch_elementwise, loads_barrier, store_pair


# ---- Numba kernels: four words of two elements per thread ----------------------------------------------
# The arrays are pair_view words (word w = elements 2w and 2w+1; bf16 as uint32, float32 as uint64);
# thread i takes words i, i+S, i+2S, i+3S (S = the threads of the grid).
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


# ---- the layer ---------------------------------------------------------------------------------
def gelu_forward(dev, out, inp) -> None:
    """out = gelu(inp), any shape. Overwrites out."""
    launch_elementwise(dev, gelu_forward_pairs_kernel, gelu_forward_kernel, (out, inp))


def gelu_backward(dev, dinp, inp, dout, accumulate: bool = True) -> None:
    """dinp += gelu'(inp) * dout (accumulates), or dinp = gelu'(inp) * dout (accumulate=False: overwrites,
    dinp not read)."""
    launch_elementwise(dev, gelu_backward_pairs_kernel, gelu_backward_kernel, (dinp, inp, dout), accumulate)
