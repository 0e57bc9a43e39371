"""bfloat16 in the kernels: bf16 values stored as uint16 bit patterns, converted with integer arithmetic.

The device functions here are llmz.bf16's NumPy arithmetic one element at a time, bit for bit (its docstring
has the formulas and the hash). Every 32-bit quantity is held in a uint64 and masked after each multiply:
Numba promotes uint32 arithmetic to 64 bits anyway, and so the simulator (NumPy scalars) and the GPU (LLVM
integers) compute the same words. Constants are np.uint64 (a uint64 mixed with a signed integer would make
Numba compute in float64). float32 <-> uint32 is the scalar `.view`, a bitcast in the PTX.

One kernel source for float and bf16 storage: kernels read and write activations through
    load(a, i)   a[i] as a float (uint16: the float32 value of the bf16 bits, exact)
    store(a, i, v)   a[i] = v (uint16: v as float32, rounded to nearest bf16, ties to even)
    store_add(a, i, v)   a[i] = a[i] + v (uint16: the add in float32, the sum rounded once)
(i an int or a tuple). On float32/float64 arrays they are the plain a[i], a[i] = v, a[i] += v. The choice is
made per array dtype: on the GPU while Numba compiles the kernel (an `overload` returns the body for the
argument's type), in the simulator at run time (the Python functions below pick the same bodies).

Layer functions (kernel on gpu/sim, reference on cpu), both overwriting out:
    to_bf16(dev, out_u16, x_f32, mode='nearest'|'stochastic', seed, step, offset=0)
    from_bf16(dev, out_f32, x_u16)
round_bf16 is also the rounding of the bf16 AdamW (llmz.kernels.adamw) and ZeRO-2 accumulate
(llmz.kernels.accumulate) kernels.
"""
import numpy as np
from numba import cuda, types
from numba.cuda.extending import overload

from ..bf16 import (
    EXP_MASK,
    GOLDEN,
    HALF_MINUS_1,
    M16,
    M32,
    MANT_MASK,
    MIX_K1,
    MIX_K2,
    QUIET,
    bf16_to_f32,
    f32_to_bf16,
    f32_to_bf16_stochastic,
)
from .grid import ceil_div

MODES = ("nearest", "stochastic")
S15 = np.uint64(15)
S16 = np.uint64(16)
ONE = np.uint64(1)


def hash_args(seed: int, step: int, offset: int = 0) -> tuple:
    """The kernel arguments of the hash: seed and step modulo 2^32, offset as uint64 (all non-negative)."""
    if offset < 0:
        raise ValueError(f"hash index offset must be >= 0, got {offset}")
    return np.uint64(seed & 0xFFFFFFFF), np.uint64(step & 0xFFFFFFFF), np.uint64(offset)


# ---- NumPy reference ----------------------------------------------------------------------------
def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown rounding mode {mode!r}; choose one of {', '.join(MODES)}")


def to_bf16_ref(out, x, mode="nearest", seed=0, step=0, offset=0):
    """out: uint16, x: float32, same shape. Overwrites out with x rounded to bf16 bits."""
    check_mode(mode)
    out[...] = f32_to_bf16_stochastic(x, seed, step, offset) if mode == "stochastic" else f32_to_bf16(x)


def from_bf16_ref(out, x):
    """out: float32, x: uint16 bf16 bits, same shape. Overwrites out (exact)."""
    out[...] = bf16_to_f32(x)


# ---- Numba device functions: the integer arithmetic of llmz.bf16, one element at a time ------------
@cuda.jit(device=True)
def f32_bits(x):
    """float32 x -> its bit pattern (a uint32 value in a uint64)."""
    return np.uint64(np.float32(x).view(np.uint32))


@cuda.jit(device=True)
def bf16_to_f32_dev(h):
    """bf16 bits h -> float32 (exact): the 16 bits become the top half of a float32."""
    return np.uint32(np.uint64(h) << S16).view(np.float32)


@cuda.jit(device=True)
def mix32_dev(x):
    """Wellons' lowbias32 on a uint32 value held in a uint64: two multiplies, three xor-shifts."""
    x = x ^ (x >> S16)
    x = (x * MIX_K1) & M32
    x = x ^ (x >> S15)
    x = (x * MIX_K2) & M32
    return x ^ (x >> S16)


@cuda.jit(device=True)
def random_u32_dev(seed, index, step):
    """seed, step: uint64 < 2^32; index: any integer (taken mod 2^32). The element's random word."""
    # one key per (seed, step)
    key = mix32_dev(seed ^ mix32_dev((step + GOLDEN) & M32))
    # one word per element
    return mix32_dev(mix32_dev(np.uint64(index) & M32) ^ key)


@cuda.jit(device=True)
def round_nearest_bits(bits):
    """float32 bits -> bf16 bits, round to nearest, ties to even; NaN -> quiet NaN (sign kept)."""
    if (bits & EXP_MASK) == EXP_MASK and (bits & MANT_MASK) != 0:
        return np.uint16(((bits >> S16) | QUIET) & M16)
    # add 0x7FFF plus the lowest kept bit, then truncate
    return np.uint16(((bits + HALF_MINUS_1 + ((bits >> S16) & ONE)) >> S16) & M16)


@cuda.jit(device=True)
def round_stochastic_bits(bits, r):
    """float32 bits -> bf16 bits, rounded up with probability (dropped bits) / 2^16 (r: a random word)."""
    # inf and NaN: no random carry (inf stays inf, NaN becomes a quiet NaN)
    if (bits & EXP_MASK) == EXP_MASK:
        return round_nearest_bits(bits)
    # add a random 16-bit integer to the dropped bits and truncate: a carry is the round-up
    return np.uint16(((bits + (r & M16)) >> S16) & M16)


@cuda.jit(device=True)
def round_bf16(x, stochastic, seed, index, step):
    """float32 x -> bf16 bits, stochastically (with the random word of (seed, index, step)) or to nearest."""
    bits = f32_bits(x)
    if stochastic:
        return round_stochastic_bits(bits, random_u32_dev(seed, index, step))
    return round_nearest_bits(bits)


# ---- element accessors: the same kernel source for float arrays and bf16 (uint16 bits) arrays -------
def _load_bf16(a, i):
    return bf16_to_f32_dev(a[i])


def _load_plain(a, i):
    return a[i]


def _store_bf16(a, i, v):
    a[i] = round_nearest_bits(f32_bits(v))


def _store_plain(a, i, v):
    a[i] = v


def load(a, i):
    """a[i] as a float: for uint16 the float32 value of the bf16 bits (exact), otherwise the element itself."""
    return (_load_bf16 if a.dtype == np.uint16 else _load_plain)(a, i)


def store(a, i, v):
    """a[i] = v. Overwrites. uint16: v as float32, rounded to nearest bf16 (ties to even); otherwise a plain
    store (cast to a's dtype)."""
    (_store_bf16 if a.dtype == np.uint16 else _store_plain)(a, i, v)


def store_add(a, i, v):
    """a[i] = a[i] + v. Accumulates. uint16: the bf16 value widened to float32, the add in float32 (float64
    when v is float64), the sum rounded to nearest bf16; otherwise exactly a[i] += v."""
    store(a, i, load(a, i) + v)


# on the GPU: the body for the array's type, chosen while Numba compiles the kernel
@overload(load, target="cuda")
def _load_cuda(a, i):
    return _load_bf16 if a.dtype == types.uint16 else _load_plain


@overload(store, target="cuda")
def _store_cuda(a, i, v):
    return _store_bf16 if a.dtype == types.uint16 else _store_plain


@overload(store_add, target="cuda")
def _store_add_cuda(a, i, v):
    return store_add


# ---- Numba kernels: one thread per element ------------------------------------------------------
@cuda.jit
def to_bf16_kernel(out, x, stochastic, seed, step, offset, n):
    """out: (n,) uint16; x: (n,) float32. Overwrites out; element i draws at hash index offset + i."""
    i = cuda.grid(1)
    if i < n:
        out[i] = round_bf16(x[i], stochastic, seed, offset + np.uint64(i), step)


@cuda.jit
def from_bf16_kernel(out, x, n):
    """out: (n,) float32; x: (n,) uint16. Overwrites out."""
    i = cuda.grid(1)
    if i < n:
        out[i] = bf16_to_f32_dev(x[i])


# ---- the layer: the kernel's launch -------------------------------------------------------------
def to_bf16(dev, out_u16, x_f32, mode="nearest", seed=0, step=0, offset=0):
    """out_u16 (uint16 bf16 bits) <- x_f32 rounded, same shape. Overwrites out. mode 'stochastic' draws the
    random word of element k (flattened) at index offset + k for (seed, step)."""
    check_mode(mode)
    n = x_f32.size
    dev.launch(to_bf16_kernel, ceil_div(n, dev.block_size), dev.block_size,
               out_u16.reshape(-1), x_f32.reshape(-1), mode == "stochastic", *hash_args(seed, step, offset), n)


def from_bf16(dev, out_f32, x_u16):
    """out_f32 <- the float32 values of the bf16 bits x_u16, same shape. Overwrites out (exact)."""
    n = x_u16.size
    dev.launch(from_bf16_kernel, ceil_div(n, dev.block_size), dev.block_size,
               out_f32.reshape(-1), x_u16.reshape(-1), n)
