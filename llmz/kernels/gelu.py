"""GELU, the tanh approximation GPT-2 uses:

    gelu(x) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),   s = sqrt(2/pi)
    gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) s (1 + 3 * 0.044715 x^2),   u = s (x + 0.044715 x^3)

Arrays are float32, float64 or uint16 (bf16 bits, computed in float32, results rounded to nearest): the
kernels read and write through llmz.kernels.bf16's load / store (the backward's += is a load, an add and a
store, as store_add does it).

The kernels give each thread ELEMS_PER_THREAD = 4 elements a grid apart (i, i+S, i+2S, i+3S, S = the threads
of the grid) and issue all their loads before any math or store: one 2-byte bf16 load per thread left too few
bytes in flight per SM to reach the H200's bandwidth (one element per thread, bf16, d12 B=16 T=1024: forward
1003 GB/s, backward 1270 GB/s). Each load instruction still reads consecutive elements across a warp. The
arithmetic per element is unchanged, so the results are the same bits as one thread per element.

On the GPU the layer functions go one step further for float32 and bf16 arrays of even size: the paired kernels
(gelu_forward_pairs_kernel, gelu_backward_pairs_kernel) read and write WORDS of two neighbouring elements
(llmz.kernels.bf16's pair_view / load_pair / store_pair: a bf16 pair is one 4-byte load, a float32 pair one
8-byte load), four words a grid apart per thread, so 8 elements per thread. With 2-byte loads a warp moves
64 bytes per load instruction, and the four-element kernels stayed far below the memory's rate. The "before"
(four elements per thread, bf16, d12 B=16 T=1024, on an H200 of about 4.8 TB/s): forward 1.72 ms per step
(1.4 TB/s), backward 2.40 ms (1.5 TB/s); after: forward 1.29 ms (1.9 TB/s), backward (overwriting) 1.62 ms
(2.2 TB/s). The per-element arithmetic is that of the scalar kernels (gelu_value /
gelu_grad in float32), so the results are the same bits. The scalar kernels stay for float64, odd sizes and
the simulator's layer path (tests launch the paired kernels directly there).

gelu_backward accumulates (+=) by default; accumulate=False overwrites dinp without reading it (a read less,
and the caller need not zero dinp first).
"""
import math

import numpy as np
from numba import config, cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, load_pair, pair_view, store, store_pair

GELU_SCALE = math.sqrt(2.0 / math.pi)
# the kernels' constants in the inputs' precision: a float64 constant would turn every float32 element's
# arithmetic (tanh included) into float64, which runs at a fraction of the float32 rate
S32, C32, HALF, ONE = np.float32(GELU_SCALE), np.float32(0.044715), np.float32(0.5), np.float32(1.0)
THREE_C32 = np.float32(3.0 * 0.044715)


# ---- NumPy reference ----------------------------------------------------------------------------
def gelu_forward_ref(out, inp):
    """out, inp: any shape, same size. Overwrites out."""
    if is_bf16(out) or is_bf16(inp):
        return run_in_f32(gelu_forward_ref, (out, inp), written=(0,))
    x = inp
    out[...] = 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + 0.044715 * (x * x * x))))   # x*x*x: np.power is slow


def gelu_backward_ref(dinp, inp, dout, accumulate: bool = True):
    """dinp += gelu'(inp) * dout: accumulates into dinp; accumulate=False overwrites dinp (never read)."""
    if is_bf16(dinp) or is_bf16(inp) or is_bf16(dout):
        def ref(dinp, inp, dout):
            gelu_backward_ref(dinp, inp, dout, accumulate)
        return run_in_f32(ref, (dinp, inp, dout), written=(0,))
    x = inp
    u = GELU_SCALE * (x + 0.044715 * (x * x * x))
    t = np.tanh(u)
    local = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x)
    if accumulate:
        dinp += local * dout
    else:
        dinp[...] = local * dout


# ---- Numba kernels: four elements per thread --------------------------------------------------
# elements per thread; the kernels below are written out for 4 (x0..x3), the launches divide by it
ELEMS_PER_THREAD = 4


# A compiler barrier between a kernel's loads and its math, so that all the loads are issued before the
# first one is waited for: cuda.syncwarp() (a NOP in the SASS; every lane of the warp must reach it, so it
# sits before any branch). Without it LLVM sinks the first element's loads into its `if` and ptxas puts
# some below that element's math (gelu_backward_kernel: 9 loads, then tanh waiting on x0, then 2 more
# loads). The simulator has no syncwarp, and no compiler to reorder anything.
if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def loads_barrier():
        pass
else:
    @cuda.jit(device=True)
    def loads_barrier():
        cuda.syncwarp()


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


@cuda.jit(device=True)
def gelu_value(x):
    """gelu(x) in x's precision (float32 for float32 and bf16 storage)."""
    return HALF * x * (ONE + math.tanh(S32 * (x + C32 * x * x * x)))


@cuda.jit(device=True)
def gelu_grad(x):
    """gelu'(x) in x's precision."""
    t = math.tanh(S32 * (x + C32 * x * x * x))
    return HALF * (ONE + t) + HALF * x * (ONE - t * t) * S32 * (ONE + THREE_C32 * x * x)


@cuda.jit
def gelu_forward_kernel(out, inp, n):
    """out, inp: (n,). Thread i takes elements i, i+S, i+2S, i+3S (S = cuda.gridsize(1)). Overwrites out."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n)
    # the four loads first, independent, all in flight at once
    x0, x1, x2, x3 = load(inp, j0), load(inp, j1), load(inp, j2), load(inp, j3)
    loads_barrier()
    # out = gelu(inp), the slots inside the array
    if i0 < n:
        store(out, i0, gelu_value(x0))
    if i1 < n:
        store(out, i1, gelu_value(x1))
    if i2 < n:
        store(out, i2, gelu_value(x2))
    if i3 < n:
        store(out, i3, gelu_value(x3))


@cuda.jit(device=True)
def added(accumulate, d, v):
    """d + v when accumulating, else v (d is then a placeholder, never read from memory)."""
    return d + v if accumulate else v


@cuda.jit
def gelu_backward_kernel(dinp, inp, dout, n, accumulate):
    """dinp, inp, dout: (n,). Elements as in the forward kernel. Accumulates (+=) into dinp, or overwrites it
    (dinp not read) when accumulate is False."""
    i0, i1, i2, i3, j0, j1, j2, j3 = four_slots(n)
    # the loads first (inp, dout and, accumulating, the dinp added to), independent of each other
    x0, x1, x2, x3 = load(inp, j0), load(inp, j1), load(inp, j2), load(inp, j3)
    g0, g1, g2, g3 = load(dout, j0), load(dout, j1), load(dout, j2), load(dout, j3)
    d0, d1, d2, d3 = g0, g1, g2, g3                     # placeholders when overwriting
    if accumulate:
        d0, d1, d2, d3 = load(dinp, j0), load(dinp, j1), load(dinp, j2), load(dinp, j3)
    loads_barrier()
    # dinp (+)= gelu'(inp) * dout, the slots inside the array
    if i0 < n:
        store(dinp, i0, added(accumulate, d0, gelu_grad(x0) * g0))
    if i1 < n:
        store(dinp, i1, added(accumulate, d1, gelu_grad(x1) * g1))
    if i2 < n:
        store(dinp, i2, added(accumulate, d2, gelu_grad(x2) * g2))
    if i3 < n:
        store(dinp, i3, added(accumulate, d3, gelu_grad(x3) * g3))


# ---- Numba kernels: four words of two elements per thread (float32 and bf16 on the GPU) -----------
# The arrays are pair_view words (word w = elements 2w and 2w+1; bf16 as uint32, float32 as uint64);
# thread i takes words i, i+S, i+2S, i+3S, as the kernels above take elements.
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


def elementwise_blocks(dev, n: int) -> int:
    """Blocks for n elements (or pair words), ELEMS_PER_THREAD per thread (0 for n = 0: nothing to launch)."""
    return ceil_div(n, ELEMS_PER_THREAD * dev.block_size)


def pairs_apply(dev, *xs) -> bool:
    """The paired kernels apply: on the GPU, float32 or bf16 (uint16) arrays of an even size, each starting on
    a word boundary (a view at an odd element would make misaligned word loads)."""
    return dev.kind == "gpu" and xs[0].size % 2 == 0 and \
        all(x.dtype in (np.float32, np.uint16) and address(x) % (2 * x.itemsize) == 0 for x in xs)


def address(x) -> int:
    """The address of x's first element (CuPy or NumPy)."""
    return x.data.ptr if hasattr(x.data, "ptr") else x.ctypes.data


def words(x):
    """x flattened, as pair_view words."""
    return pair_view(x.reshape(-1))


def launch_elementwise(dev, kernel, pairs_kernel, arrays, *extra) -> None:
    """An elementwise layer's launch over its same-size arrays, flattened: pairs_kernel on their words where
    pairs_apply, else kernel on their elements; each kernel takes (*arrays, count, *extra)."""
    n = arrays[0].size
    if pairs_apply(dev, *arrays):
        dev.launch(pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
                   *(words(x) for x in arrays), n // 2, *extra)
    else:
        dev.launch(kernel, elementwise_blocks(dev, n), dev.block_size, *(x.reshape(-1) for x in arrays), n, *extra)


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def gelu_forward(dev, out, inp) -> None:
    """out = gelu(inp), any shape. Overwrites out."""
    if not dev.kernels:
        return gelu_forward_ref(out, inp)
    launch_elementwise(dev, gelu_forward_kernel, gelu_forward_pairs_kernel, (out, inp))


def gelu_backward(dev, dinp, inp, dout, accumulate: bool = True) -> None:
    """dinp += gelu'(inp) * dout (accumulates), or dinp = gelu'(inp) * dout (accumulate=False: overwrites,
    dinp not read)."""
    if not dev.kernels:
        return gelu_backward_ref(dinp, inp, dout, accumulate)
    launch_elementwise(dev, gelu_backward_kernel, gelu_backward_pairs_kernel, (dinp, inp, dout), accumulate)
