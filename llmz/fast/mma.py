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


# ---- moving tiles: 16-byte loads, cp.async into shared memory, ldmatrix out of it ----------------------
# A tile row of one head is 64 bf16 = 128 bytes = 8 chunks of 16 bytes. cp.async copies a chunk from global to
# shared memory without passing through registers and without making the thread wait: a tile's copies are
# issued, committed as a group, and waited for (cp_async_wait) only when the tile is needed, so the next
# tile's copies fly while this tile's mmas run. ldmatrix then reads fragments out of the row-major tile, one
# instruction for four 8 x 8 matrices of bf16: lanes 8i..8i+7 give the addresses of the 8 rows (16 bytes
# each) of matrix i, and every lane receives one register of each matrix:
#     ldmatrix .x4        lane 4g+t, register i = matrix i's row g, elements 2t, 2t+1
#     ldmatrix .x4.trans  lane 4g+t, register i = matrix i's rows 2t, 2t+1, element g (one column's pair)
# The first is an mma B fragment of S = Q K^T read from K's rows (b[0]: key g, channels 2t, 2t+1); the
# second a B fragment of O = P V read from V's rows (b[0]: keys 2t, 2t+1, channel g): no transposed copy.
# Shared rows padded to PAD words (PAD % 32 == 4, PAD % 4 == 0): the 8 rows of one matrix start 4 banks
# apart (no bank conflict) and every row starts on 16 bytes (cp.async and ldmatrix need it).
def ldmatrix_rows_lane(lane, pad):
    """Word offset (in a row-major shared tile of `pad`-word rows) of the row address lane gives ldmatrix .x4
    for two k-steps of a B fragment: rows 0..7, words 4i..4i+3 for matrix i = lane // 8. At tile offset
    8j*pad + 16kp, registers (r0, r1) are (b[0], b[1]) of n-tile j, k-step 2kp; (r2, r3) of k-step 2kp+1."""
    return (lane % 8) * pad + 4 * (lane // 8)


def ldmatrix_trans_lane(lane, pad):
    """Word offset of the row address lane gives ldmatrix .x4.trans for two n-tiles of a B fragment stored
    k-major (rows = k): matrix i covers rows 8(i % 2).., words 4(i // 2)... At tile offset 16kk*pad + 8jp,
    registers (r0, r1) are (b[0], b[1]) of k-step kk, n-tile 2jp; (r2, r3) of n-tile 2jp+1."""
    return (lane % 8 + 8 * (lane // 8 % 2)) * pad + 4 * (lane // 16)


def tile_copy_chunk(tid, i, nthreads, chunks=8):
    """(row, chunk): the 16-byte chunk of a tile (`chunks` chunks a row: 8 for a head of 64 bf16) that thread
    tid copies in its i-th pass (nthreads threads): `chunks` neighbouring threads read one row's bytes."""
    return tid // chunks + (nthreads // chunks) * i, tid % chunks


@intrinsic
def shared_address(typingctx, arr, index):
    """The 32-bit .shared byte address of arr[index], arr a 1-D shared array (cuda.shared.array): the
    address ldmatrix and cp.async take (llvm addrspacecast to addrspace 3, i.e. cvta.to.shared)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    sig = types.uint32(arr, index)

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        i = context.cast(builder, args[1], sig.args[1], types.intp)
        p = builder.gep(a.data, [i], inbounds=True)
        s = builder.addrspacecast(p, ir.PointerType(p.type.pointee, 3))
        return builder.ptrtoint(s, _I32)
    return sig, codegen


def _ldmatrix_codegen(op):
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
        asm = ir.InlineAsm(fnty, op + " {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}", side_effect=True)
        d = builder.call(asm, [context.cast(builder, args[0], sig.args[0], types.uint32)])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])
    return codegen


@intrinsic
def ldmatrix_x4(typingctx, addr):
    """(addr: this lane's row address, uint32 .shared bytes) -> (r0, r1, r2, r3) uint32: register i = matrix
    i's row lane // 4, bf16 elements 2 (lane % 4), +1. Warp-wide (every lane, no divergence)."""
    return (types.UniTuple(types.uint32, 4)(addr),
            _ldmatrix_codegen("ldmatrix.sync.aligned.m8n8.x4.shared.b16"))


@intrinsic
def ldmatrix_x4_trans(typingctx, addr):
    """As ldmatrix_x4, transposed: register i = matrix i's rows 2 (lane % 4) (low half) and 2 (lane % 4) + 1
    (high half) at column lane // 4."""
    return (types.UniTuple(types.uint32, 4)(addr),
            _ldmatrix_codegen("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"))


def _flat_pointer(context, builder, arrty, arr, index, indexty):
    a = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, index, indexty, types.intp)
    return builder.gep(a.data, [i], inbounds=True)


def _cp_async_codegen(op):
    def codegen(context, builder, sig, args):
        p = _flat_pointer(context, builder, sig.args[1], args[1], args[2], sig.args[2])
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, p.type, _I32]), op, "r,l,r,~{memory}",
                           side_effect=True)
        builder.call(asm, [context.cast(builder, args[0], sig.args[0], types.uint32), p,
                           context.cast(builder, args[3], sig.args[3], types.uint32)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def cp_async16(typingctx, saddr, arr, index, src_bytes):
    """(saddr: uint32 .shared address, arr: a C-contiguous global array, index: flat element index, src_bytes:
    16 or 0): start copying the 16 bytes at arr's flat element `index` (16-byte aligned) to saddr; with
    src_bytes = 0 nothing is read and 16 zero bytes are written (a row past the end). Done at cp_async_wait."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        return None
    return (types.void(saddr, arr, index, src_bytes),
            _cp_async_codegen("cp.async.cg.shared.global [$0], [$1], 16, $2;"))


@intrinsic
def cp_async4(typingctx, saddr, arr, index, src_bytes):
    """As cp_async16 for 4 bytes (src_bytes 4 or 0): one float32 at any 4-byte boundary."""
    if not (isinstance(arr, types.Array) and arr.layout == "C"):
        return None
    return (types.void(saddr, arr, index, src_bytes),
            _cp_async_codegen("cp.async.ca.shared.global [$0], [$1], 4, $2;"))


@intrinsic
def cp_async_commit(typingctx):
    """Close the group of this thread's cp.async copies issued since the last commit."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                                  side_effect=True), [])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def cp_async_wait(typingctx, pending):
    """Wait until at most `pending` (a literal int) of this thread's committed groups are in flight. Other
    threads' copies are visible only after a syncthreads that follows every thread's wait."""
    if not isinstance(pending, types.IntegerLiteral):
        return None
    n = pending.literal_value
    sig = types.void(pending)

    def codegen(context, builder, sig, args):
        builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {n};", "~{memory}",
                                  side_effect=True), [])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def load4_at(typingctx, arr, index):
    """(w0, w1, w2, w3) = arr's flat elements index..index+3 (a C-contiguous array of 32-bit elements,
    index a multiple of 4): one 16-byte load (ld.v4), unchecked."""
    if not (isinstance(arr, types.Array) and arr.layout == "C" and arr.dtype.bitwidth == 32):
        return None
    sig = types.UniTuple(arr.dtype, 4)(arr, index)

    def codegen(context, builder, sig, args):
        p = _flat_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        v = builder.load(builder.bitcast(p, ir.PointerType(ir.VectorType(p.type.pointee, 4))), align=16)
        return context.make_tuple(builder, sig.return_type, [builder.extract_element(v, ir.Constant(_I32, i))
                                                            for i in range(4)])
    return sig, codegen


_rows_lane = cuda.jit(device=True, inline=True)(ldmatrix_rows_lane)
_trans_lane = cuda.jit(device=True, inline=True)(ldmatrix_trans_lane)
_copy_chunk = cuda.jit(device=True, inline=True)(tile_copy_chunk)
PROBE_PAD = 36
PROBE_WORDS = 64 * PROBE_PAD


@cuda.jit
def tile_probe_kernel(tile, floats, ldm, ldm_t, v4, x, f, T):
    # One block of 128 threads, the tile path in code: x (64, 32) words -> a 64-row shared tile of 36-word rows
    # by cp_async16 (rows >= T zero-filled), f (64,) float32 -> shared by cp_async4 (past T: 0); then warp 0
    # reads fragments: ldm[n] (32, 4) = ldmatrix_x4 at ldmatrix_rows_lane + (0, then 8*36 + 16) words,
    # ldm_t[n] = ldmatrix_x4_trans at ldmatrix_trans_lane + (0, then 16*36 + 8); v4 (32, 4) = load4_at(x, 4 lane).
    # tile (64*36,), floats (64,): the shared memory after the copies (padding words: 0xFFFFFFFF). Overwrites all.
    s = cuda.shared.array(PROBE_WORDS, types.uint32)
    sf = cuda.shared.array(64, types.float32)
    tid = cuda.threadIdx.x
    for i in range(PROBE_WORDS // 128):
        s[tid + 128 * i] = 0xFFFFFFFF
    cuda.syncthreads()
    base, fbase = shared_address(s, 0), shared_address(sf, 0)
    for i in range(4):
        r, c = _copy_chunk(tid, i, 128, 8)
        ok = r < T
        cp_async16(base + 4 * (r * PROBE_PAD + 4 * c), x, (r if ok else 0) * 32 + 4 * c, 16 if ok else 0)
    if tid < 64:
        cp_async4(fbase + 4 * tid, f, tid if tid < T else 0, 4 if tid < T else 0)
    cp_async_commit()
    cp_async_wait(0)
    cuda.syncthreads()
    for i in range(PROBE_WORDS // 128):
        tile[tid + 128 * i] = s[tid + 128 * i]
    if tid < 64:
        floats[tid] = sf[tid]
    if tid < 32:
        for n in range(2):
            r0, r1, r2, r3 = ldmatrix_x4(base + 4 * (_rows_lane(tid, PROBE_PAD) + n * (8 * PROBE_PAD + 16)))
            ldm[n, tid, 0], ldm[n, tid, 1], ldm[n, tid, 2], ldm[n, tid, 3] = r0, r1, r2, r3
            r0, r1, r2, r3 = ldmatrix_x4_trans(base + 4 * (_trans_lane(tid, PROBE_PAD) + n * (16 * PROBE_PAD + 8)))
            ldm_t[n, tid, 0], ldm_t[n, tid, 1], ldm_t[n, tid, 2], ldm_t[n, tid, 3] = r0, r1, r2, r3
        w0, w1, w2, w3 = load4_at(x, 4 * tid)
        v4[tid, 0], v4[tid, 1], v4[tid, 2], v4[tid, 3] = w0, w1, w2, w3
