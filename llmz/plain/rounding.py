"""Lesson 04's stochastic rounding, plain: ZeRO-2's bf16 gradient shard += my slice of a bf16 slot, the sum
taken in float32 and rounded back to bf16 stochastically, then the slot zeroed (llmz.kernels.accumulate's
accumulate_shard_bf16 in one kernel, the same bits for finite values). bf16 values live as uint16 bit
patterns: a float32's upper 16 bits (llmz/bf16.py)."""
from __future__ import annotations

import numpy as np

from llmz.bf16 import bf16_to_f32, random_u32


def accumulate_shard_bf16(shard, slot, rank: int, seed: int, step: int, offset: int = 0) -> None:
    """shard: (n,) bf16 bits; slot: (N*n,). shard = bf16(shard + slot[rank*n:(rank+1)*n]); slot = 0.
    Shard element j draws its random word at index offset + j."""
    n = shard.size
    total = bf16_to_f32(shard) + bf16_to_f32(slot[rank * n:(rank + 1) * n])     # in float32
    shard[...] = round_stochastic(total, seed, step, offset)
    slot[...] = 0


def round_stochastic(x, seed: int, step: int, offset: int = 0) -> np.ndarray:
    """float32 x -> bf16 bits, rounded up with probability (the dropped 16 bits) / 2^16: on average, x."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    # a random 16-bit word per element, hashed from (seed, its index, step): no generator, no state
    r = random_u32(seed, offset + np.arange(bits.size), step) & 0xFFFF
    # added to the dropped bits: a carry into the kept bits is the round-up; then the low 16 bits go
    return ((bits + r) >> 16).astype(np.uint16)
