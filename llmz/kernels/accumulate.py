"""ZeRO-2's gradient accumulation: after a block's gradients are reduce-scattered in place inside their slot
of the two-slot buffer, add this rank's part into its gradient shard and zero the whole slot, so the next
block that uses the slot starts from zero:

    shard[i] += slot[rank*n + i]    for i < n          (n = shard size; the slot holds N*n, N ranks)
    slot[:] = 0

ONE kernel does both (llm.c PR #593 review: fuse the memset into the vector add): one thread per slot
element reads it, adds it to the shard if it is this rank's, and writes the zero. Every element of the slot
is read and written by exactly one thread, so the order cannot matter.

This version adds in the shard's own dtype (float32 or float64: an exact IEEE add). The bf16 shard with
stochastic rounding (llm.c's reason: many micro-steps of small bf16 adds would otherwise round to nothing)
goes in its own kernel below the fp32 one, with its own reference; `accumulate_shard` picks it by dtype.
"""
from numba import cuda

from ..device import ceil_div


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


# ---- bf16 shard with stochastic rounding: not written yet (its kernel, reference and tests go here) ----


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def accumulate_shard(dev, shard, slot, rank, stream=None):
    """shard: (n,); slot: (N*n,). shard += slot[rank*n:(rank+1)*n]; slot = 0. One kernel, no memset.
    stream: where it runs (default the compute stream; ZeRO-2 runs it on the comm stream)."""
    n, total = shard.size, slot.size
    if total % n or not 0 <= rank < total // n:
        raise ValueError(f"slot of {total} elements does not hold rank {rank}'s shard of {n}")
    if not dev.kernels:
        return accumulate_shard_ref(shard, slot, rank)
    dev.launch(accumulate_shard_kernel, ceil_div(total, dev.block_size), dev.block_size,
               shard, slot, rank, n, total, stream=stream)
