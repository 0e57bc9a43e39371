"""The residual connection's fast kernels. The math, shapes and dtypes are llmz/kernels/residual.py's.

residual_forward_pairs_kernel and residual_backward_pairs_kernel replace the teaching residual_forward_kernel
and residual_backward_kernel (one thread per element) for float32 and bf16 arrays of even size starting on
a word boundary: four words of two elements per thread (llmz.fast.device_helpers, as llmz.fast.gelu), every
load issued before any store, a 4-byte load per bf16 pair. Other arrays take the teaching kernels.
Contract: the same bits as the teaching kernels (the same float32 add per element, one rounding).
residual_forward overwrites out; residual_backward accumulates (+=) into dinp1 and dinp2.
"""
from numba import cuda

from ..kernels.residual import residual_backward_kernel, residual_forward_kernel
from .device_helpers import four_pairs, four_slots, launch_elementwise, loads_barrier, store_pair


# ---- Numba kernels: four words of two elements per thread ----------------------------------------------
# pair_view words (word w = elements 2w and 2w+1), thread i takes words i, i+S, i+2S, i+3S
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
def add_into_both(dinp1, dinp2, n_words, i, d0, d1, p0, p1, q0, q1):
    """Word i of dinp1 and of dinp2, if i < n_words: their loaded pairs (p0, p1) and (q0, q1) plus dout's
    (d0, d1)."""
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
    add_into_both(dinp1, dinp2, n_words, i0, d0, d1, p0, p1, q0, q1)
    add_into_both(dinp1, dinp2, n_words, i1, d2, d3, p2, p3, q2, q3)
    add_into_both(dinp1, dinp2, n_words, i2, d4, d5, p4, p5, q4, q5)
    add_into_both(dinp1, dinp2, n_words, i3, d6, d7, p6, p7, q6, q7)


# ---- the layer ---------------------------------------------------------------------------------
def residual_forward(dev, out, inp1, inp2) -> None:
    """out = inp1 + inp2 (any shape). Overwrites out."""
    launch_elementwise(dev, residual_forward_pairs_kernel, residual_forward_kernel, (out, inp1, inp2))


def residual_backward(dev, dinp1, dinp2, dout) -> None:
    """dinp1 += dout; dinp2 += dout (dinp1, dinp2: two different arrays). Accumulates."""
    launch_elementwise(dev, residual_backward_pairs_kernel, residual_backward_kernel, (dinp1, dinp2, dout))
