"""bfloat16 on the host: the NumPy reference of every conversion the bf16 kernels do.

bf16 is float32 with the low 16 bits dropped (sign, 8 exponent bits, 7 mantissa bits). Neither NumPy nor the
Numba simulator has a bf16 type, so bf16 values live as their bit patterns in uint16 arrays; the kernels
(llmz.kernels.bf16) convert with the same integer arithmetic as the functions here, bit for bit.

    bf16 -> f32      bits << 16                                             (exact)
    f32 -> bf16      round to nearest, ties to even: (bits + 0x7FFF + lowest kept bit) >> 16
    f32 -> bf16      stochastic: (bits + r) >> 16, r a random 16-bit integer (llm.c's stochastic_rounding):
                     rounds up with probability (dropped bits) / 2^16, so the expected result is x itself
    NaN stays a quiet NaN (sign kept); +-inf stays inf; a finite value beyond bf16's range rounds to inf as
    IEEE rounding does (stochastic rounding: with the probability it would round up).

The random integer r comes from a counter-based hash of (seed, element index, step), not from a generator
with state: the same inputs give the same bits on every device and every run, so training and a resume
reproduce exactly. The hash is four rounds of a 32-bit integer mix (Wellons' "lowbias32": two multiplies
and three xor-shifts, a bijection on 32 bits):

    key  = mix32(seed ^ mix32(step + 0x9E3779B9))     one key per (seed, step)
    r    = mix32(mix32(index) ^ key)                   for a fixed key, distinct indices give distinct words

(One round on the index, mix32(index ^ key), is not enough: over 25,000 consecutive indices the number of
round-ups varies 10% more from key to key than independent draws would; with two it matches NumPy's
generator to within the measurement, 0.98 +- 0.02 of the binomial spread over 1,500 keys.)

Indices and steps are taken modulo 2^32. Callers choose the index so that one parameter draws the same bits
whichever rank or ZeRO stage rounds it (its position in the flat buffer), and different seeds for different
purposes (parameters, gradients) so those draws are independent.

This module imports no numba: the file formats (llmz.run.model_file) and host-staged communication (llmz.comm)
use it too.
"""
from __future__ import annotations

import numpy as np

# ---- the hash's constants (all arithmetic on uint32 values held in uint64, masked after each multiply) ----
M32 = np.uint64(0xFFFFFFFF)
M16 = np.uint64(0xFFFF)
MIX_K1 = np.uint64(0x7FEB352D)
MIX_K2 = np.uint64(0x846CA68B)
GOLDEN = np.uint64(0x9E3779B9)          # 2^32 / golden ratio: keeps step 0 away from mix32's fixed point 0
# ---- float32 bit fields ----
EXP_MASK = np.uint64(0x7F800000)        # exponent all ones: inf or NaN
MANT_MASK = np.uint64(0x007FFFFF)       # and a non-zero mantissa: NaN
QUIET = np.uint64(0x0040)               # bf16's quiet-NaN bit (the top mantissa bit)
HALF_MINUS_1 = np.uint64(0x7FFF)


def _u64(a) -> np.ndarray:
    return np.asarray(a).astype(np.uint64)


def mix32(x: np.ndarray) -> np.ndarray:
    """x: uint32 values in a uint64 array -> the same shape, each word scrambled (a bijection on 32 bits)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * MIX_K1) & M32
    x = x ^ (x >> np.uint64(15))
    x = (x * MIX_K2) & M32
    return x ^ (x >> np.uint64(16))


def random_u32(seed: int, index, step: int) -> np.ndarray:
    """The random 32-bit word of element `index` (int array) at `step` for `seed`: a uint64 array < 2^32."""
    # one key per (seed, step)
    key = mix32(np.uint64(seed & 0xFFFFFFFF) ^ mix32((np.uint64(step & 0xFFFFFFFF) + GOLDEN) & M32))
    # one word per element
    return mix32(mix32(_u64(index) & M32) ^ key)


def f32_to_bf16(x) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): the upper 16 bits, rounded to nearest, ties to even.
    NaN stays NaN (quiet, sign kept); values beyond bf16's range round to +-inf, as IEEE rounding does."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    # add 0x7FFF plus the lowest kept bit, then truncate: round half to even on the dropped 16 bits
    rounded = (bits + HALF_MINUS_1 + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    # NaN: keep the sign and the top mantissa bits, force the quiet bit so it cannot round to inf
    nan = ((bits & EXP_MASK) == EXP_MASK) & ((bits & MANT_MASK) != 0)
    return np.where(nan, (bits >> np.uint64(16)) | QUIET, rounded).astype(np.uint16)


def f32_to_bf16_stochastic(x, seed: int, step: int, offset: int = 0) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded up with probability (dropped bits) / 2^16. Element k of
    the flattened x draws its random word at index offset + k. inf and NaN round as f32_to_bf16 does."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    # a random 16-bit integer per element
    r = random_u32(seed, offset + np.arange(x.size, dtype=np.int64).reshape(x.shape), step) & M16
    # add it to the dropped bits and truncate: a carry into the kept bits is the round-up
    rounded = ((bits + r) >> np.uint64(16)).astype(np.uint16)
    # inf and NaN: no random carry (a NaN's carry could reach the sign bit, or truncation turn it into inf)
    special = (bits & EXP_MASK) == EXP_MASK
    return np.where(special, f32_to_bf16(x), rounded)


def bf16_to_f32(b) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly (bf16 is float32 with the low 16 bits zero)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def is_bf16(a) -> bool:
    """True for a uint16 array: bf16 values stored as their bit patterns."""
    return getattr(a, "dtype", None) == np.uint16


def run_in_f32(ref, arrays, written) -> None:
    """A NumPy reference on bf16 storage: ref(*arrays) with every uint16 (bf16 bits) array replaced by a
    float32 copy of its values, then the copies at the positions in `written` rounded to nearest (ties to
    even) back into their uint16 arrays. Float arrays pass through and are read and written in place."""
    wide = [bf16_to_f32(a) if is_bf16(a) else a for a in arrays]
    ref(*wide)
    for k in written:
        if is_bf16(arrays[k]):
            arrays[k][...] = f32_to_bf16(wide[k])
