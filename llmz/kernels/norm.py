"""The global gradient norm and gradient clipping (llm.c: global_norm_squared, and the grad_scale its AdamW takes).

    norm_sq = sum_i x_i^2                     (over one rank's gradients; ranks all-reduce norm_sq)
    scale   = clip / sqrt(norm_sq)  if clip > 0 and sqrt(norm_sq) > clip,  else 1

The sum is DETERMINISTIC (the same bits every run, so a resumed run repeats exactly): no float atomics,
two passes in a fixed order. Pass 1: each of `nblocks` blocks grid-strides over x, accumulating in float64
even for float32 x, reduces its threads in shared memory and writes scratch[block]. Pass 2: one block sums
scratch[0:nblocks] in a fixed tree order into out[0]. nblocks depends only on n and dev.block_size.
x may be float32, float64 or uint16 (bf16 bits, read exactly through llmz.kernels.bf16's load); the sum is
float64 whatever x is.

clip_scale writes the factor into scalars[1], the grad_scale slot of the array AdamW reads, on the device:
the step never waits for the host, and the whole of it can be captured as a CUDA graph.
"""
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import bf16_to_f32, is_bf16
from .bf16 import load
from .grid import ceil_div

# blocks in pass 1 on the GPU; scratch must hold at least this many float64 (the simulator uses fewer:
# at most dev.block_size blocks)
NORM_BLOCKS = 256
# the most threads per block the shared-memory reduction holds
MAX_BLOCK = 1024


# ---- NumPy reference ----------------------------------------------------------------------------
def norm_squared_ref(out, x, scratch, accumulate=False):
    """out: (1,) float64; x: (n,); scratch: unused here. Overwrites out[0] with sum(x^2), in float64
    (accumulate=True: adds it to out[0], for a norm over several arrays)."""
    # bf16 bits: their float32 values (exact)
    if is_bf16(x):
        x = bf16_to_f32(x)
    # einsum accumulates in float64 without a float64 copy of x
    s = np.einsum("i,i->", x.reshape(-1), x.reshape(-1), dtype=np.float64)
    out[0] = out[0] + s if accumulate else s


def clip_scale_ref(scalars, norm_sq, clip):
    """scalars: the AdamW scalars array; norm_sq: (1,). Overwrites scalars[1] with the clipping factor."""
    norm = math.sqrt(norm_sq[0])
    scalars[1] = clip / norm if (clip > 0 and norm > clip) else 1.0


def sum_into_ref(out, x, accumulate=True):
    """out: (1,) float64; x: any shape. out[0] (+)= the sum of x, in float64."""
    out[0] = (out[0] if accumulate else 0.0) + x.sum(dtype=np.float64)


def global_norm_ref(arrays) -> float:
    """sqrt(sum of squares) over a list of host arrays, in float64 (for tests and logs)."""
    return math.sqrt(sum(float(np.einsum("i,i->", a.reshape(-1), a.reshape(-1), dtype=np.float64))
                         for a in arrays))


# ---- Numba kernels ------------------------------------------------------------------------------
# shared-memory block reductions, the teaching kernels' (layernorm, classifier, the norm) and llmz.fast's
# classifier's: a tree over buf[0:n], in the same order every run. Every thread of the block calls them; thread
# tid takes slots tid, tid + blockDim, ... of each level (one slot when n <= blockDim; the fast classifier's
# paired kernels reduce n = 2 blockDim values). buf[0] holds the result on return.
@cuda.jit(device=True)
def block_reduce(buf, tid, n, take_max):
    """buf[0] = the sum of buf[0:n], or (take_max) their max."""
    half = 1
    while half < n:
        half *= 2
    half //= 2
    while half > 0:
        for i in range(tid, half, cuda.blockDim.x):
            if i + half < n:
                buf[i] = max(buf[i], buf[i + half]) if take_max else buf[i] + buf[i + half]
        cuda.syncthreads()
        half //= 2


@cuda.jit(device=True)
def block_sum(buf, tid, n):
    block_reduce(buf, tid, n, False)


@cuda.jit(device=True)
def block_max(buf, tid, n):
    block_reduce(buf, tid, n, True)


@cuda.jit(device=True)
def block_total(buf, v, take_max):
    """Every thread of the block calls it with its v: returns, in every thread, the float64 sum of the block's
    v's (take_max: their max) in the tree's order. buf: shared float64 of >= blockDim, free on return."""
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    block_reduce(buf, tid, cuda.blockDim.x, take_max)
    total = buf[0]
    cuda.syncthreads()                  # everyone has read buf[0] before buf is reused
    return total


@cuda.jit
def norm_partial_kernel(scratch, x, n):
    """Pass 1, grid of nblocks: scratch[block] = sum of x[i]^2 over the i this block strides over."""
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # each thread: a grid-stride loop, accumulating in float64
    s = np.float64(0.0)
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        xi = numba.float64(load(x, i))
        s += xi * xi
    # the block's threads, in a fixed tree order
    total = block_total(buf, s, False)
    if cuda.threadIdx.x == 0:
        scratch[cuda.blockIdx.x] = total


@cuda.jit
def norm_final_kernel(out, scratch, nblocks, accumulate):
    """Pass 2, one block: out[0] = sum of scratch[0:nblocks], in a fixed order. Overwrites out[0]
    (accumulate: adds to it)."""
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    s = np.float64(0.0)
    for j in range(cuda.threadIdx.x, nblocks, cuda.blockDim.x):
        s += scratch[j]
    total = block_total(buf, s, False)
    if cuda.threadIdx.x == 0:
        out[0] = out[0] + total if accumulate else total


@cuda.jit
def clip_scale_kernel(scalars, norm_sq, clip):
    """One thread: scalars[1] = clip / norm when clipping is on and the norm exceeds it, else 1."""
    if cuda.grid(1) == 0:
        norm = math.sqrt(norm_sq[0])
        scalars[1] = clip / norm if (clip > 0.0 and norm > clip) else 1.0


# ---- the layer: the kernel's launch -------------------------------------------------------------
def norm_blocks(dev, n: int) -> int:
    """Blocks in pass 1 for n elements: fixed by n and dev.block_size, so the summation order is too."""
    return max(1, min(NORM_BLOCKS, dev.block_size, ceil_div(n, dev.block_size)))


def norm_squared(dev, out, x, scratch, accumulate: bool = False):
    """out: (1,) float64; x: (n,); scratch: float64, at least NORM_BLOCKS. Overwrites out[0] with sum(x^2);
    accumulate=True adds it to out[0] instead (a norm over several arrays, each added in turn)."""
    n = x.size
    nblocks = norm_blocks(dev, n)
    assert scratch.size >= nblocks, (scratch.size, nblocks)
    dev.launch(norm_partial_kernel, nblocks, dev.block_size, scratch, x.reshape(-1), n)
    dev.launch(norm_final_kernel, 1, dev.block_size, out, scratch, nblocks, bool(accumulate))


def sum_into(dev, out, x, accumulate: bool = True):
    """out: (1,) float64; x: any shape. out[0] (+)= the sum of x, in float64 and a fixed order (one block:
    meant for small x, such as the (B,T) losses of a micro-step, summed on the device with no host read)."""
    dev.launch(norm_final_kernel, 1, dev.block_size, out, x.reshape(-1), x.size, bool(accumulate))


def clip_scale(dev, scalars, norm_sq, clip):
    """scalars: float64 AdamW scalars; norm_sq: (1,) float64. Overwrites scalars[1] (grad_scale)."""
    dev.launch(clip_scale_kernel, 1, 1, scalars, norm_sq, float(clip))
