# Exercise for lesson 04: llmz/plain/rounding.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     python -m lessons.04_stochastic_rounding --mine lessons/exercises/04_rounding.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
#
# Lesson 04's stochastic rounding, plain: ZeRO-2's bf16 gradient shard += my slice of a bf16 slot, the sum
# taken in float32 and rounded back to bf16 stochastically, then the slot zeroed (llmz.kernels.accumulate's
# accumulate_shard_bf16 in one kernel, the same bits for finite values). bf16 values live as uint16 bit
# patterns: a float32's upper 16 bits (llmz/bf16.py).
from __future__ import annotations

import numpy as np

from llmz.bf16 import bf16_to_f32, random_u32


def accumulate_shard_bf16(shard, slot, rank: int, seed: int, step: int, offset: int = 0) -> None:
    """shard: (n,) bf16 bits; slot: (N*n,). shard = bf16(shard + slot[rank*n:(rank+1)*n]); slot = 0.
    Shard element j draws its random word at index offset + j."""
    n = shard.size
    raise NotImplementedError("gap 1 of 3: the sum, total: my shard plus my slice of the slot (rank's n "
                              "values), both widened to float32 (bf16_to_f32)")
    shard[...] = round_stochastic(total, seed, step, offset)
    slot[...] = 0


def round_stochastic(x, seed: int, step: int, offset: int = 0) -> np.ndarray:
    """float32 x -> bf16 bits, rounded up with probability (the dropped 16 bits) / 2^16: on average, x."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    # a random 16-bit word per element, hashed from (seed, its index, step): no generator, no state
    raise NotImplementedError("gap 2 of 3: a random 16-bit word per element, r, from llmz.bf16.random_u32(seed,"
                              " index, step): element k's index is offset + k")
    # added to the dropped bits: a carry into the kept bits is the round-up; then the low 16 bits go
    raise NotImplementedError("gap 3 of 3: add r to the float32 bits and keep the upper 16 (as uint16): when do"
                              " the dropped bits carry into the kept ones, and how often?")
