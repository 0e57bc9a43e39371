"""Device helpers the fast kernels share: warp reductions, words of two elements, four slots a thread, launch
helpers. One copy of each; the teaching kernels (llmz.kernels) need none of them.

  warps     warp_row: one row per warp; warp_sum and warp_max_sum: xor butterflies over the 32 lanes, so every
            lane ends with the same bits, added in the same order every run (the simulator emulates the
            shuffle: llmz.device)
  pairs     a bf16 pair as one uint32 word, a float32 pair as one uint64 word (pair_view; element 2w in the
            low half, 2w+1 in the high half: little-endian). A warp of 2-byte loads moves 64 bytes per load
            instruction, and bf16 kernels then run at the load-instruction rate, not the memory's; a word
            moves two elements. load_pair / store_pair convert as llmz.kernels.bf16's load / store do
  slots     four elements (or words) a grid apart per thread, every load issued before any math
            (four_slots, four_pairs, loads_barrier): enough bytes in flight per SM
  launches  bounded_jit (launch bounds on the GPU), elementwise_blocks, pairs_apply, words
"""
import math

import numba
import numpy as np
from numba import config, cuda, types
from numba.cuda.extending import overload

from ..bf16 import M16, M32
from ..kernels.bf16 import S16, bf16_to_f32_dev, f32_bits, round_nearest_bits
from ..kernels.grid import ceil_div

WARP = 32                   # threads per warp
FULL_MASK = 0xFFFFFFFF      # every lane of the warp takes part in a shuffle
ELEMS_PER_THREAD = 4        # elements (or words) per thread of the elementwise kernels: four_slots
S32 = np.uint64(32)


def bounded_jit(max_threads: int, min_blocks: int):
    """cuda.jit with launch bounds (max_threads per block, min_blocks per SM) on the GPU; plain cuda.jit in the
    simulator, which takes no launch bounds (and has no registers to bound)."""
    return cuda.jit if config.ENABLE_CUDASIM else cuda.jit(launch_bounds=(max_threads, min_blocks))


# ---- warps ----------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def warp_row():
    """(row, lane) of this thread: warp w of block b takes row b * (blockDim/32) + w. The warps past the last
    row leave as a whole warp, so no shuffle ever misses a lane. The lane is tid & 31 (= tid % 32): the
    compiler then knows it is never negative and drops the negative-index test from every row[lane + 32k]."""
    tid = cuda.threadIdx.x
    return cuda.blockIdx.x * (cuda.blockDim.x // WARP) + tid // WARP, tid & (WARP - 1)


@cuda.jit(device=True)
def warp_sum(v):
    """The sum of v over the 32 lanes of a warp, returned in every lane. An xor butterfly: lane i adds the
    value of lane i^16, then i^8, i^4, i^2, i^1; each pair adds the same two numbers, so every lane ends with
    the same bits, and the order is the same every run. All 32 lanes must call it."""
    offset = WARP // 2
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        offset //= 2
    return v


@cuda.jit(device=True)
def softmax_combine(m, s, mo, so):
    """Two partial softmax sums (running max m, sum s of exp(x - m), float32) -> one, against the larger max;
    an empty part (m = -inf, s = 0) adds nothing. Symmetric: (mo, so, m, s) gives the same bits."""
    mn = max(m, mo)
    if mn == -math.inf:
        return mn, numba.float32(0.0)
    a = s * math.exp(m - mn) if m != -math.inf else numba.float32(0.0)
    b = so * math.exp(mo - mn) if mo != -math.inf else numba.float32(0.0)
    return mn, a + b


@cuda.jit(device=True)
def warp_max_sum(m, s):
    """Every lane's partial (max, sum of exp(x - max)) -> the row's, in every lane: warp_sum's butterfly,
    combining with softmax_combine (symmetric, so both lanes of each pair get the same bits)."""
    offset = WARP // 2
    while offset > 0:
        m, s = softmax_combine(m, s, cuda.shfl_xor_sync(FULL_MASK, m, offset),
                               cuda.shfl_xor_sync(FULL_MASK, s, offset))
        offset //= 2
    return m, s


# ---- pairs: two neighbouring elements per 4- or 8-byte word --------------------------------------------
def _load_pair_bf16(a, i):
    w = np.uint64(a[i])
    return bf16_to_f32_dev(w & M16), bf16_to_f32_dev(w >> S16)


def _load_pair_f32(a, i):
    w = np.uint64(a[i])
    return np.uint32(w & M32).view(np.float32), np.uint32(w >> S32).view(np.float32)


def _store_pair_bf16(a, i, v0, v1):
    a[i] = np.uint32(np.uint64(round_nearest_bits(f32_bits(v0))) | (np.uint64(round_nearest_bits(f32_bits(v1))) << S16))


def _store_pair_f32(a, i, v0, v1):
    a[i] = f32_bits(v0) | (f32_bits(v1) << S32)


def load_pair(a, i):
    """Word a[i] as its two elements (float32): a uint32 word holds two bf16, a uint64 word two float32."""
    return (_load_pair_bf16 if a.dtype == np.uint32 else _load_pair_f32)(a, i)


def store_pair(a, i, v0, v1):
    """Word a[i] = (v0, v1): bf16 rounded to nearest (uint32 words) or float32 (uint64 words). Overwrites."""
    (_store_pair_bf16 if a.dtype == np.uint32 else _store_pair_f32)(a, i, v0, v1)


# on the GPU: the body for the array's type, chosen while Numba compiles the kernel (as llmz.kernels.bf16's)
@overload(load_pair, target="cuda")
def _load_pair_cuda(a, i):
    return _load_pair_bf16 if a.dtype == types.uint32 else _load_pair_f32


@overload(store_pair, target="cuda")
def _store_pair_cuda(a, i, v0, v1):
    return _store_pair_bf16 if a.dtype == types.uint32 else _store_pair_f32


def pair_view(x):
    """The paired view of a float32 or bf16 array whose last axis has an even length (CuPy or NumPy)."""
    return x.view(np.uint32 if x.dtype == np.uint16 else np.uint64)


# ---- slots: four elements (or words) a grid apart per thread ------------------------------------------------
# A compiler barrier between a kernel's loads and its math, so that all the loads are issued before the
# first one is waited for: cuda.syncwarp() (a NOP in the SASS; every lane of the warp must reach it, so it
# sits before any branch). Without it LLVM sinks the first element's loads into its `if` and ptxas puts
# some below that element's math. The simulator has no syncwarp, and no compiler to reorder anything.
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


# ---- launches -------------------------------------------------------------------------------------------
def elementwise_blocks(dev, n: int) -> int:
    """Blocks for n elements (or pair words), ELEMS_PER_THREAD per thread (0 for n = 0: nothing to launch)."""
    return ceil_div(n, ELEMS_PER_THREAD * dev.block_size)


def address(x) -> int:
    """The address of x's first element (CuPy or NumPy)."""
    return x.data.ptr if hasattr(x.data, "ptr") else x.ctypes.data


def pairs_apply(*xs) -> bool:
    """The paired kernels apply to these same-size arrays: float32 or bf16 (uint16), an even size, each starting
    on a word boundary (a view at an odd element would make misaligned word loads)."""
    return xs[0].size % 2 == 0 and \
        all(x.dtype in (np.float32, np.uint16) and address(x) % (2 * x.itemsize) == 0 for x in xs)


def words(x):
    """x flattened, as pair_view words."""
    return pair_view(x.reshape(-1))


def launch_elementwise(dev, pairs_kernel, teaching_kernel, arrays, *extra) -> None:
    """An elementwise layer over its same-size arrays, flattened: pairs_kernel on their words, four words a
    thread, where pairs_apply; else the teaching kernel, one thread per element. Each kernel takes
    (*arrays, count, *extra)."""
    n = arrays[0].size
    if pairs_apply(*arrays):
        dev.launch(pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
                   *(words(x) for x in arrays), n // 2, *extra)
    else:
        dev.launch_per_element(teaching_kernel, arrays, *extra)
