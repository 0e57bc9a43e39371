"""16-byte loads and stores, and the few fast float32 instructions the memory-bound kernels use (llm.c's
x128 / Packed128, cuda_utils.cuh): the helpers of the unit candidates in dev/ (dev/gelu.py, residual, adamw,
column_sum, layernorm, classifier, encoder, matmul), not yet run on a GPU. They move to llmz/fast/ with the
first candidate promoted there (tools/kern_gpu.sh, BENCHMARKS.md).

A warp of 2-byte loads moves 64 bytes per load instruction, of 4-byte word loads 128: the bf16 kernels then
run at the load-instruction rate or the latency of too few bytes in flight, not at the memory's rate. Here a
thread moves 16 bytes per instruction (PTX ld.global.v4.u32 / st.global.v4.u32; SASS LDG.E.128, STG.E.128),
a warp 512 bytes.

  units     a UNIT is 8 neighbouring elements: one 16-byte vector of bf16 (uint16 bits) or two of float32.
            load8(a, e) -> the 8 elements a[e:e+8] as float32; store8(a, e, v0..v7) writes them (bf16:
            rounded to nearest, ties to even) and returns the 8 values as stored (float32). a is a 1-D
            C-contiguous uint16 or float32 array; e a multiple of 8 and &a[e] 16-byte aligned (units_fit
            says whether an array's units are: the layers check it and take another kernel where not).
  words     load16(a, e) -> the 16 bytes at element e as 4 uint32 words (bf16_pair / f32_word unpack them):
            a kernel that holds a row in registers keeps bf16 as words, half the registers of floats
  math      exp2_approx, rcp_approx: PTX ex2.approx.f32 and rcp.approx.f32 (one multi-function-unit
            instruction each, ~2 ulp): the elementwise kernels' exp and division (the libdevice versions
            are ~20 instructions and made GELU compute-bound in bf16)

On the GPU these are Numba intrinsics (llvmlite IR: a <4 x i32> load through an addrspace(1) pointer, inline
PTX for the conversions and approximations); in the simulator, plain Python on the same bits (the
approximations there are NumPy's exact float32 functions, so a simulated kernel may differ from the GPU's in
the last bits of an exp or a reciprocal).
"""
import math

import numpy as np
from llvmlite import ir
from numba import config, cuda, types
from numba.cuda.extending import intrinsic, overload

from llmz.fast.device_helpers import address
from llmz.kernels.bf16 import f32_bits, round_nearest_bits

UNIT = 8                    # elements per unit
VECTOR_BYTES = 16           # bytes per load / store instruction
_I32, _F32 = ir.IntType(32), ir.FloatType()
_V4 = ir.VectorType(_I32, 4)
_HI16 = np.uint32(0xFFFF0000)
_S16 = np.uint32(16)


def units_fit(*xs) -> bool:
    """The unit kernels apply to these arrays: float32 or bf16 (uint16), C-contiguous, a whole number of units
    (size % 8 == 0) and starting on 16 bytes. (A row-wise kernel also needs its row length % 8 == 0.)"""
    return all(x.dtype in (np.float32, np.uint16) and x.flags.c_contiguous and x.size % UNIT == 0
               and address(x) % VECTOR_BYTES == 0 for x in xs)


# ---- the GPU's intrinsics ------------------------------------------------------------------------------
def _global_vector_pointer(context, builder, sig, args):
    """&a[e] of a C-contiguous array as a <4 x i32> pointer in the global address space (16-byte aligned:
    the caller's promise)."""
    a = context.make_array(sig.args[0])(context, builder, args[0])
    e = context.cast(builder, args[1], sig.args[1], types.intp)
    p = builder.gep(a.data, [e], inbounds=True)
    return builder.addrspacecast(builder.bitcast(p, _V4.as_pointer()), _V4.as_pointer(1))


@intrinsic
def _load16_gpu(typingctx, a, e):
    if not isinstance(a, types.Array):
        return None
    sig = types.UniTuple(types.uint32, 4)(a, e)

    def codegen(context, builder, sig, args):
        v = builder.load(_global_vector_pointer(context, builder, sig, args), align=VECTOR_BYTES)
        words = [builder.extract_element(v, ir.Constant(_I32, k)) for k in range(4)]
        return context.make_tuple(builder, sig.return_type, words)
    return sig, codegen


@intrinsic
def _store16_gpu(typingctx, a, e, w0, w1, w2, w3):
    if not isinstance(a, types.Array):
        return None
    sig = types.void(a, e, types.uint32, types.uint32, types.uint32, types.uint32)

    def codegen(context, builder, sig, args):
        v = ir.Constant(_V4, ir.Undefined)
        for k in range(4):
            v = builder.insert_element(v, args[2 + k], ir.Constant(_I32, k))
        builder.store(v, _global_vector_pointer(context, builder, sig, args), align=VECTOR_BYTES)
        return context.get_dummy_value()
    return sig, codegen


def _ptx_f32(instruction: str):
    """An intrinsic float32 -> float32 running one PTX instruction."""
    @intrinsic
    def op(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), f"{instruction} $0, $1;", "=f,f")
            return builder.call(asm, args)
        return sig, codegen
    return op


@intrinsic
def _pack_bf16x2_gpu(typingctx, lo, hi):
    sig = types.uint32(types.float32, types.float32)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return builder.call(asm, [args[1], args[0]])       # the first source goes to the upper half
    return sig, codegen


# ---- the simulator's twins: the same bits in Python --------------------------------------------------
def _load16_sim(a, e):
    if a.dtype == np.uint16:
        return tuple(np.uint32(a[e + 2 * k]) | (np.uint32(a[e + 2 * k + 1]) << _S16) for k in range(4))
    return tuple(np.float32(a[e + k]).view(np.uint32) for k in range(4))


def _store16_sim(a, e, w0, w1, w2, w3):
    for k, w in enumerate((w0, w1, w2, w3)):
        w = np.uint32(w)
        if a.dtype == np.uint16:
            a[e + 2 * k] = np.uint16(w & np.uint32(0xFFFF))
            a[e + 2 * k + 1] = np.uint16(w >> _S16)
        else:
            a[e + k] = w.view(np.float32)


def _pack_bf16x2_sim(lo, hi):
    return np.uint32(round_nearest_bits(f32_bits(lo))) | (np.uint32(round_nearest_bits(f32_bits(hi))) << _S16)


if config.ENABLE_CUDASIM:
    load16, store16, pack_bf16x2 = _load16_sim, _store16_sim, _pack_bf16x2_sim

    def exp2_approx(x):
        return np.float32(2.0 ** np.float64(x)) if x > -150 else np.float32(0.0)

    def rcp_approx(x):
        return np.float32(1.0) / np.float32(x)
else:
    load16, store16, pack_bf16x2 = _load16_gpu, _store16_gpu, _pack_bf16x2_gpu
    exp2_approx = _ptx_f32("ex2.approx.f32")
    rcp_approx = _ptx_f32("rcp.approx.f32")

LOG2E = np.float32(1.0 / math.log(2.0))


# ---- words -> floats ---------------------------------------------------------------------------------
@cuda.jit(device=True)
def bf16_pair(w):
    """A word of two bf16 -> (element 2k, element 2k+1) as float32 (exact)."""
    w = np.uint32(w)
    return np.uint32(w << _S16).view(np.float32), np.uint32(w & _HI16).view(np.float32)


@cuda.jit(device=True)
def pack_bf16x2_bits(lo, hi):
    """Two bf16 bit patterns -> the word holding them (lo in bits 0..15, the lower-index element)."""
    return np.uint32(lo) | np.uint32(np.uint32(hi) << _S16)


@cuda.jit(device=True)
def f32_word(w):
    """A word holding one float32's bits -> the float32."""
    return np.uint32(w).view(np.float32)


@cuda.jit(device=True)
def f32_bits32(v):
    """float32 -> its bits as a uint32 word."""
    return np.float32(v).view(np.uint32)


# ---- units: 8 elements as float32 ---------------------------------------------------------------------
def _load8_bf16(a, e):
    w0, w1, w2, w3 = load16(a, e)
    x0, x1 = bf16_pair(w0)
    x2, x3 = bf16_pair(w1)
    x4, x5 = bf16_pair(w2)
    x6, x7 = bf16_pair(w3)
    return x0, x1, x2, x3, x4, x5, x6, x7


def _load8_f32(a, e):
    w0, w1, w2, w3 = load16(a, e)
    w4, w5, w6, w7 = load16(a, e + 4)
    return (f32_word(w0), f32_word(w1), f32_word(w2), f32_word(w3),
            f32_word(w4), f32_word(w5), f32_word(w6), f32_word(w7))


def _store8_bf16(a, e, v0, v1, v2, v3, v4, v5, v6, v7):
    w0, w1, w2, w3 = pack_bf16x2(v0, v1), pack_bf16x2(v2, v3), pack_bf16x2(v4, v5), pack_bf16x2(v6, v7)
    store16(a, e, w0, w1, w2, w3)
    x0, x1 = bf16_pair(w0)
    x2, x3 = bf16_pair(w1)
    x4, x5 = bf16_pair(w2)
    x6, x7 = bf16_pair(w3)
    return x0, x1, x2, x3, x4, x5, x6, x7


def _store8_f32(a, e, v0, v1, v2, v3, v4, v5, v6, v7):
    x0, x1, x2, x3 = np.float32(v0), np.float32(v1), np.float32(v2), np.float32(v3)
    x4, x5, x6, x7 = np.float32(v4), np.float32(v5), np.float32(v6), np.float32(v7)
    store16(a, e, f32_bits32(x0), f32_bits32(x1), f32_bits32(x2), f32_bits32(x3))
    store16(a, e + 4, f32_bits32(x4), f32_bits32(x5), f32_bits32(x6), f32_bits32(x7))
    return x0, x1, x2, x3, x4, x5, x6, x7


def load8(a, e):
    """Elements a[e:e+8] of a bf16 (uint16) or float32 array as 8 float32 (one or two 16-byte loads)."""
    return (_load8_bf16 if a.dtype == np.uint16 else _load8_f32)(a, e)


def store8(a, e, v0, v1, v2, v3, v4, v5, v6, v7):
    """a[e:e+8] = v0..v7 (bf16: rounded to nearest, ties to even; float32: as they are), one or two 16-byte
    stores. Returns the 8 values as stored, as float32 (bf16: the rounded ones)."""
    return (_store8_bf16 if a.dtype == np.uint16 else _store8_f32)(a, e, v0, v1, v2, v3, v4, v5, v6, v7)


@overload(load8, target="cuda")
def _load8_cuda(a, e):
    return _load8_bf16 if a.dtype == types.uint16 else _load8_f32


@overload(store8, target="cuda")
def _store8_cuda(a, e, v0, v1, v2, v3, v4, v5, v6, v7):
    return _store8_bf16 if a.dtype == types.uint16 else _store8_f32


@cuda.jit(device=True)
def load8_into(v, k, a, e):
    """v[k:k+8] = load8(a, e) (v a local float32 array, k a constant after unrolling: registers)."""
    v[k], v[k + 1], v[k + 2], v[k + 3], v[k + 4], v[k + 5], v[k + 6], v[k + 7] = load8(a, e)


@cuda.jit(device=True)
def store8_from(a, e, v, k):
    """store8(a, e, v[k:k+8])."""
    store8(a, e, v[k], v[k + 1], v[k + 2], v[k + 3], v[k + 4], v[k + 5], v[k + 6], v[k + 7])


# ---- elementwise kernels: two units a thread ------------------------------------------------------------
UNITS_PER_THREAD = 2        # units a thread of an elementwise kernel loads before any math (16 or 32 bytes
                            # each per array: with 2 units, ~64 KB in flight per SM for a bf16 pair of arrays)


@cuda.jit(device=True)
def two_slots(n_units):
    """This thread's units i0, i1 = i, i + S (S = the threads of the grid) and the element offsets e0, e1 it
    loads them from: 8 i, or the last unit's for a slot past the end (a valid address, never stored)."""
    i0 = cuda.grid(1)
    i1 = i0 + cuda.gridsize(1)
    last = n_units - 1
    return i0, i1, UNIT * min(i0, last), UNIT * min(i1, last)


@cuda.jit(device=True)
def load_slots(v, a, e0, e1):
    """v[0:8], v[8:16] = a thread's two units of a (at elements e0, e1: two_slots)."""
    load8_into(v, 0, a, e0)
    load8_into(v, UNIT, a, e1)


@cuda.jit(device=True)
def store_slots(a, v, i0, i1, e0, e1, n_units):
    """A thread's two units of a (units i0, i1 at elements e0, e1) = v[0:8], v[8:16], each one inside the array."""
    if i0 < n_units:
        store8_from(a, e0, v, 0)
    if i1 < n_units:
        store8_from(a, e1, v, UNIT)


@cuda.jit(device=True)
def add_store_slots(a, v, w, i0, i1, e0, e1, n_units):
    """store_slots of v + w (v is overwritten with the sums): an add of two loaded slots, stored."""
    for k in range(2 * UNIT):
        v[k] += w[k]
    store_slots(a, v, i0, i1, e0, e1, n_units)


def unit_blocks(dev, n: int) -> int:
    """Blocks of an elementwise unit kernel over n elements (n % 8 == 0): UNITS_PER_THREAD units a thread."""
    return max(1, -(-n // (UNIT * UNITS_PER_THREAD * dev.block_size)))


def launch_units(dev, units_kernel, teaching, arrays, *extra) -> None:
    """An elementwise layer over its same-size arrays, flattened: units_kernel(*arrays, n_units, *extra) where
    units_fit, else the teaching layer function teaching(dev, *arrays, *extra) (float64, a size not a
    multiple of 8, a view not on 16 bytes)."""
    if not units_fit(*arrays) or arrays[0].size == 0:
        return teaching(dev, *arrays, *extra)
    n = arrays[0].size
    dev.launch(units_kernel, unit_blocks(dev, n), dev.block_size, *(x.reshape(-1) for x in arrays), n // UNIT,
               *extra)
