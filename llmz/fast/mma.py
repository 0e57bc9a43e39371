"""Tensor cores from Numba: the warp-wide PTX `mma.sync` (and a bf16 pack) as Numba intrinsics.

Numba has no mma/wmma API; an `@intrinsic` whose code generation calls llvmlite's `ir.InlineAsm` puts the PTX
instruction into the kernel as written (the simulator cannot run it: GPU only). One mma is one warp-wide
product D = A B + C, every lane of the warp holding a few elements of each matrix in registers, in the layout
below (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"). With lane = 4 * g + t
(g = lane // 4, the "group", 0..7; t = lane % 4, 0..3) and A, B in bf16 (two to a 32-bit register, the
lower-index element in the low half), C and D in float32:

    A (16 x 16, row-major): 4 registers          B (16 x 8, "col": K down, N across): 2 registers
          cols 2t,2t+1   cols 8+2t,8+2t+1              rows 2t,2t+1     -> b[0]      col g
    row g      a[0]          a[2]                      rows 8+2t,8+2t+1 -> b[1]      col g
    row g+8    a[1]          a[3]                (a lane's B words are two neighbouring elements of one
                                                  COLUMN of B: a row of B^T, e.g. of K for S = Q K^T)
    C, D (16 x 8): 4 float32                      lane 0 (g=0,t=0): A[0][0:2], A[8][0:2], A[0][8:10],
          cols 2t, 2t+1                           A[8][8:10]; B[0:2][0], B[8:10][0]; C[0][0:2], C[8][0:2]
    row g      c[0], c[1]                         lane 5 (g=1,t=1): A[1][2:4], A[9][2:4], A[1][10:12], ...
    row g+8    c[2], c[3]

So a lane's accumulator row pair (g, g+8) and column pair (2t, 2t+1) in C is the same place as its A
registers a[0], a[1] for columns 0..7: two C tiles (columns 0..7 and 8..15), each packed to bf16 pairs, are
one A fragment (C tile n0 -> a[0] = pack(c[0], c[1]), a[1] = pack(c[2], c[3]); tile n0+1 -> a[2], a[3]).
FlashAttention keeps P = softmax(S) in registers that way, from S = Q K^T straight into O += P V.
"""
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

_F32, _I32 = ir.FloatType(), ir.IntType(32)


@intrinsic
def mma_m16n8k16_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(a0..a3: uint32 A registers, b0, b1: uint32 B registers, c0..c3: float32 C) -> (d0, d1, d2, d3)
    float32: D = A B + C, the warp's 16 x 16 by 16 x 8 bf16 product accumulated in float32. Every lane of
    the warp must call it together (no divergence)."""
    u32, f32 = types.uint32, types.float32
    sig = types.UniTuple(f32, 4)(u32, u32, u32, u32, u32, u32, f32, f32, f32, f32)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
        asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                 "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                           "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        d = builder.call(asm, args)
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])
    return sig, codegen


@intrinsic
def pack_bf16x2(typingctx, lo, hi):
    """(lo, hi: float32) -> uint32 holding both rounded to nearest bf16 (ties to even): lo in bits 0..15,
    hi in bits 16..31, the order of a pair of neighbouring bf16 elements in memory and in mma's registers."""
    sig = types.uint32(types.float32, types.float32)

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return builder.call(asm, [args[1], args[0]])       # the first source goes to the upper half
    return sig, codegen


@cuda.jit
def mma_tile_kernel(d, packed, a, bt, c):
    # One warp, one product, the layout above in code: d (16,8) float32 = A (16,16) @ B (16,8) + c (16,8).
    # a (16,8) uint32: A's rows as bf16 pairs; bt (8,8) uint32: B's columns (rows of B^T) as bf16 pairs.
    # packed (16,4) uint32: d's rows as bf16 pairs (pack_bf16x2). Overwrites d and packed.
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    d0, d1, d2, d3 = mma_m16n8k16_bf16(a[g, t], a[g + 8, t], a[g, 4 + t], a[g + 8, 4 + t],
                                       bt[g, t], bt[g, 4 + t],
                                       c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = d0, d1, d2, d3
    packed[g, t] = pack_bf16x2(d0, d1)
    packed[g + 8, t] = pack_bf16x2(d2, d3)


# ---- unchecked loads and stores at base + offset: fragment addressing ---------------------------------
# A kernel reads its fragments from shared tiles at (lane's base) + (a constant per unrolled step). Numba's
# own indexing (negative-index wraparound, 2-D strides) made LLVM hoist every one of those addresses out of
# the tile loop into its own 64-bit register (the forward kernel used 255 registers); as two `inbounds`
# GEPs, the constant folds into the load's immediate offset ([%rd + 1152]) and one register serves all.
@intrinsic
def load_at(typingctx, arr, base, offset):
    """arr[base + offset] of a 1-D C-contiguous array, unchecked (no wraparound, no bounds)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    sig = arr.dtype(arr, base, offset)

    def codegen(context, builder, sig, args):
        return builder.load(_element_pointer(context, builder, sig, args))
    return sig, codegen


@intrinsic
def store_at(typingctx, arr, base, offset, value):
    """arr[base + offset] = value (cast to arr's dtype), unchecked, as load_at."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    sig = types.void(arr, base, offset, value)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[3], sig.args[3], sig.args[0].dtype)
        builder.store(v, _element_pointer(context, builder, sig, args))
    return sig, codegen


def _element_pointer(context, builder, sig, args):
    a = context.make_array(sig.args[0])(context, builder, args[0])
    base = context.cast(builder, args[1], sig.args[1], types.intp)
    offset = context.cast(builder, args[2], sig.args[2], types.intp)
    return builder.gep(builder.gep(a.data, [base], inbounds=True), [offset], inbounds=True)
