"""The residual connection: out = inp1 + inp2; backward passes dout to both inputs unchanged.

Arrays are float32, float64 or uint16 (bf16 bits, added in float32, results rounded to nearest): the kernels
read and write through llmz.kernels.bf16's load / store (+= as a load, an add and a store, as store_add does it).

As in llmz.kernels.gelu, each thread takes ELEMS_PER_THREAD = 4 elements a grid apart and issues all its loads
before its stores, so that bf16's 2-byte loads keep enough bytes in flight (one element per thread, bf16:
forward 836 GB/s on the H200). The adds are unchanged: the same bits as one thread per element.

On the GPU, float32 and bf16 arrays of even size go through the paired kernels (residual_forward_pairs_kernel,
residual_backward_pairs_kernel): four words of two elements per thread (llmz.kernels.bf16's pair_view words,
as in llmz.kernels.gelu), a 4-byte load per bf16 pair. Before the pairs (four 2-byte elements per thread, bf16,
d12 B=16 T=1024): forward 0.90 ms per step (2.0 TB/s of the H200's ~4.8); after: 0.64 ms (2.8 TB/s). The same float32 adds: the same bits.
"""
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store, store_pair
from .gelu import four_pairs, four_slots, launch_elementwise, loads_barrier


# ---- NumPy reference ----------------------------------------------------------------------------
def residual_forward_ref(out, inp1, inp2):
    """out, inp1, inp2: any shape, same size. Overwrites out."""
    if is_bf16(out) or is_bf16(inp1) or is_bf16(inp2):
        return run_in_f32(residual_forward_ref, (out, inp1, inp2), written=(0,))
    out[...] = inp1 + inp2


def residual_backward_ref(dinp1, dinp2, dout):
    """dinp1, dinp2, dout: any shape, same size; dinp1 and dinp2 are two different arrays. Accumulates (+=)
    into dinp1 and dinp2."""
    if is_bf16(dinp1) or is_bf16(dinp2) or is_bf16(dout):
        return run_in_f32(residual_backward_ref, (dinp1, dinp2, dout), written=(0, 1))
    dinp1 += dout
    dinp2 += dout


# ---- Numba kernels: four elements per thread (ELEMS_PER_THREAD, llmz.kernels.gelu) ---------------
@cuda.jit
def residual_forward_kernel(out, inp1, inp2, n):
    """out, inp1, inp2: (n,). Thread i takes elements i, i+S, i+2S, i+3S (S = cuda.gridsize(1)).
    Overwrites out."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n)
    # the eight loads first, independent, all in flight at once
    a0, a1, a2, a3 = load(inp1, j0), load(inp1, j1), load(inp1, j2), load(inp1, j3)
    b0, b1, b2, b3 = load(inp2, j0), load(inp2, j1), load(inp2, j2), load(inp2, j3)
    loads_barrier()
    # out = inp1 + inp2, the slots inside the array
    if i0 < n:
        store(out, i0, a0 + b0)
    if i1 < n:
        store(out, i1, a1 + b1)
    if i2 < n:
        store(out, i2, a2 + b2)
    if i3 < n:
        store(out, i3, a3 + b3)


@cuda.jit
def residual_backward_kernel(dinp1, dinp2, dout, n):
    """dinp1, dinp2, dout: (n,), dinp1 and dinp2 different arrays (both are read before either is written).
    Elements as in the forward kernel. Accumulates (+=) into dinp1 and dinp2."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n)
    # the twelve loads first: dout and the two gradients being accumulated into
    d0, d1, d2, d3 = load(dout, j0), load(dout, j1), load(dout, j2), load(dout, j3)
    p0, p1, p2, p3 = load(dinp1, j0), load(dinp1, j1), load(dinp1, j2), load(dinp1, j3)
    q0, q1, q2, q3 = load(dinp2, j0), load(dinp2, j1), load(dinp2, j2), load(dinp2, j3)
    loads_barrier()
    # dinp1 += dout; dinp2 += dout, the slots inside the array
    if i0 < n:
        store(dinp1, i0, p0 + d0)
        store(dinp2, i0, q0 + d0)
    if i1 < n:
        store(dinp1, i1, p1 + d1)
        store(dinp2, i1, q1 + d1)
    if i2 < n:
        store(dinp1, i2, p2 + d2)
        store(dinp2, i2, q2 + d2)
    if i3 < n:
        store(dinp1, i3, p3 + d3)
        store(dinp2, i3, q3 + d3)


# ---- Numba kernels: four words of two elements per thread (float32 and bf16 on the GPU) -----------
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
    if i0 < n_words:
        store_pair(dinp1, i0, p0 + d0, p1 + d1)
        store_pair(dinp2, i0, q0 + d0, q1 + d1)
    if i1 < n_words:
        store_pair(dinp1, i1, p2 + d2, p3 + d3)
        store_pair(dinp2, i1, q2 + d2, q3 + d3)
    if i2 < n_words:
        store_pair(dinp1, i2, p4 + d4, p5 + d5)
        store_pair(dinp2, i2, q4 + d4, q5 + d5)
    if i3 < n_words:
        store_pair(dinp1, i3, p6 + d6, p7 + d7)
        store_pair(dinp2, i3, q6 + d6, q7 + d7)


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def residual_forward(dev, out, inp1, inp2) -> None:
    """out = inp1 + inp2 (any shape). Overwrites out."""
    if not dev.kernels:
        return residual_forward_ref(out, inp1, inp2)
    launch_elementwise(dev, residual_forward_kernel, residual_forward_pairs_kernel, (out, inp1, inp2))


def residual_backward(dev, dinp1, dinp2, dout) -> None:
    """dinp1 += dout; dinp2 += dout (dinp1, dinp2: two different arrays). Accumulates."""
    if not dev.kernels:
        return residual_backward_ref(dinp1, dinp2, dout)
    launch_elementwise(dev, residual_backward_kernel, residual_backward_pairs_kernel, (dinp1, dinp2, dout))
