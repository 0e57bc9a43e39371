"""ZeRO-2's gradient accumulation: after a block's gradients are reduce-scattered in place inside their slot
of the two-slot buffer, add this rank's part into its gradient shard and zero the whole slot, so the next
block that uses the slot starts from zero:

    shard[i] += slot[rank*n + i]    for i < n          (n = shard size; the slot holds N*n, N ranks)
    slot[:] = 0

ONE kernel does both (llm.c PR #593 review: fuse the memset into the vector add): one thread per slot
element reads it, adds it to the shard if it is this rank's, and writes the zero. Every element of the slot
is read and written by exactly one thread, so the order cannot matter.

`accumulate_shard` adds in the shard's own dtype (float32 or float64: one IEEE add). `accumulate_shard_bf16`
is the same kernel for bf16 shard and slot (uint16 bit patterns): it adds in fp32 and rounds the sum back to
bf16 stochastically (llm.c's reason, PR #593: over many micro-steps the accumulated gradient grows and each new
small gradient falls below half a bf16 ulp; round-to-nearest would drop it every time, stochastic rounding
keeps the sum right in expectation), or to nearest for comparison. The rounding is llmz.kernels.bf16's.
"""
import numpy as np
from numba import cuda

from ..bf16 import M32, bf16_to_f32, f32_to_bf16, f32_to_bf16_stochastic
from .bf16 import bf16_to_f32_dev, hash_args, round_bf16
from .grid import ceil_div


# ---- NumPy reference ----------------------------------------------------------------------------
def accumulate_shard_ref(shard, slot, rank):
    """shard: (n,); slot: (N*n,). shard += slot[rank*n:(rank+1)*n] (accumulates); slot = 0 (overwrites)."""
    n = shard.size
    # add this rank's averaged gradient into its shard
    shard += slot[rank * n:(rank + 1) * n]
    # zero the slot for the next block that uses it
    slot[...] = 0


# ---- Numba kernel: one thread per slot element ---------------------------------------------------
@cuda.jit
def accumulate_shard_kernel(shard, slot, rank, n, total):
    """shard: (n,); slot: (total,) = (N*n,). Accumulates into shard, overwrites slot with zeros."""
    i = cuda.grid(1)
    if i < total:
        j = i - rank * n
        # this rank's part of the slot: add into the shard
        if 0 <= j < n:
            shard[j] += slot[i]
        # every element: zero it
        slot[i] = 0


# ---- bf16 shard and slot (uint16 bits): add in fp32, round back stochastically -----------------------
def accumulate_shard_bf16_ref(shard, slot, rank, seed, step, stochastic=True, offset=0):
    """shard: (n,) uint16; slot: (N*n,) uint16. shard = bf16(shard + slot[rank*n:(rank+1)*n]) (accumulates);
    slot = 0 (overwrites). Shard element j draws its random word at hash index offset + j."""
    n = shard.size
    # add in fp32
    total = bf16_to_f32(shard) + bf16_to_f32(slot[rank * n:(rank + 1) * n])
    # round back to bf16
    shard[...] = f32_to_bf16_stochastic(total, seed, step, offset) if stochastic else f32_to_bf16(total)
    # zero the slot for the next block that uses it
    slot[...] = 0


@cuda.jit
def accumulate_shard_bf16_kernel(shard, slot, rank, n, total, stochastic, seed, steps, offset):
    """shard: (n,) uint16; slot: (total,) = (N*n,) uint16; steps: (1,) uint64, the micro-step (read on the
    device, so a replayed CUDA graph draws fresh words). Accumulates into shard, overwrites slot."""
    i = cuda.grid(1)
    step = steps[0] & M32
    if i < total:
        j = i - rank * n
        if 0 <= j < n:
            # this rank's part: add in fp32, round back to bf16
            s = bf16_to_f32_dev(shard[j]) + bf16_to_f32_dev(slot[i])
            shard[j] = round_bf16(s, stochastic, seed, offset + np.uint64(j), step)
        # every element: zero it
        slot[i] = 0


# ---- the layer: the kernel's launch ------------------------------------------------------------------
def check_split(n, total, rank):
    """Refuse a slot that does not hold N shards of n, or a rank not among them."""
    if total % n or not 0 <= rank < total // n:
        raise ValueError(f"slot of {total} elements does not hold rank {rank}'s shard of {n}")


def accumulate_shard(dev, shard, slot, rank, stream=None):
    """shard: (n,); slot: (N*n,). shard += slot[rank*n:(rank+1)*n]; slot = 0. One kernel, no memset.
    stream: where it runs (default the compute stream; ZeRO-2 runs it on the comm stream)."""
    n, total = shard.size, slot.size
    check_split(n, total, rank)
    dev.launch(accumulate_shard_kernel, ceil_div(total, dev.block_size), dev.block_size,
               shard, slot, rank, n, total, stream=stream)


def accumulate_shard_bf16(dev, shard_u16, slot_u16, rank, seed, step, stochastic=True, stream=None, offset=0):
    """shard_u16: (n,); slot_u16: (N*n,), bf16 bits. shard = bf16(shard + slot[rank*n:(rank+1)*n]), the sum
    taken in fp32 and rounded stochastically (or to nearest); slot = 0. One kernel, no memset.
    The random word of shard element j is that of (seed, offset + j, step): pass a different step every
    micro-step, and an offset that places the shard in the whole gradient buffer so no two elements share
    draws. step: an int, or a (1,) uint64 device array holding it (ZeRO-2 keeps its micro-step there, written
    before each micro-step, so a CUDA graph that captured this launch still draws fresh words every replay).
    stream: as in accumulate_shard (an int step only on the compute stream, where its upload is ordered)."""
    n, total = shard_u16.size, slot_u16.size
    check_split(n, total, rank)
    if isinstance(step, int):
        assert stream is None, "an int step is uploaded on the compute stream: pass a device array instead"
        step = dev.asarray(np.array([step & 0xFFFFFFFF], np.uint64))
    seed_u64, _, offset_u64 = hash_args(seed, 0, offset)
    dev.launch(accumulate_shard_bf16_kernel, ceil_div(total, dev.block_size), dev.block_size,
               shard_u16, slot_u16, rank, n, total, bool(stochastic), seed_u64, step, offset_u64,
               stream=stream)
