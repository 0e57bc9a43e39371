"""Version 12 of dev/flash_attention.py: the forward on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a), a
candidate not yet run on a GPU. The backward is version 5's (llmz.fast's).

wgmma: the 4 warps of a warpgroup (128 threads) issue one asynchronous product together, D (64 x N, float32)
= A (64 x 16) B (16 x N) (+ D), with A from registers (each warp's 16 rows as mma.m16n8k16's A fragment: the
same four words a lane) and B read by the tensor cores straight from shared memory through a 64-bit matrix
descriptor (its address, the byte strides between its 8-row core-matrix groups, its swizzle). D's layout is
mma's C layout a warp: warp w holds rows 16w + g, +8, n-tile j (columns 8j + 2t, +1) at d[4j..4j+3]. So S = Q K^T
is 4 wgmma m64n64k16 (the head's 4 k-steps of 16 channels, Q in registers, K's tile K-major: its rows are the
B columns) instead of a warp's 64 mma.m16n8k16 for 16 rows, and O += P V 4 more (P in registers as today,
V's tile read with imm-trans-b = 1: its rows are B's K axis, channels contiguous, "MN-major"), and the online
softmax in between is llmz.fast's device functions on the same registers.
Tiles are 64 rows of 128 bytes (one head's 64 bf16), in the 128-byte swizzle wgmma reads without bank
conflicts: 16-byte chunk c of row r at r*128 + (c ^ (r % 8))*16, each tile on a 1024-byte boundary; copied by
cp.async as version 5's (fence.proxy.async then makes the copies visible to the tensor cores' reads).
Descriptors (PTX ISA, "Matrix Descriptor Format"): K-major 128B swizzle: stride byte offset 1024 (the next 8
rows), leading byte offset unused (16), k-step kk at +32 bytes; MN-major 128B swizzle (V): stride 1024 (the
next 8 keys), leading 8192 (the next 64 channels: none), k-step kk (16 keys) at +2048 bytes.
Block: 2 warpgroups, 128 query rows (64 a warpgroup, 16 a warp), 2 blocks an SM (ptxas: 126 registers, no
spills, 32 KiB of shared memory); a warpgroup skips the key tiles past its last row. Each product is waited
for before the next (no overlap within a warpgroup of the softmax and the products, FlashAttention-3's
ping-pong and intra-warpgroup pipelining); the 4 warpgroups of an SM overlap each other instead.
wgmma_probe_kernel checks the instruction, descriptors and layouts alone: python dev/flash_attention_wgmma.py
(a process of its own: dev/flash_attention.py runs it so, before version 12, so that a fault stays there).
"""
import os
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmz.fast import flash_attention as fa
from llmz.fast.device_helpers import pair_view
from llmz.fast.flash_attention import (
    NEG,
    WORDS,
    block_rows,
    causal_mask,
    launch_bounds,
    load_fragments,
    online_softmax,
    pack_a,
    write_o_lse,
)
from llmz.fast.mma import cp_async16, cp_async_commit, cp_async_wait, shared_address
from llmz.kernels.grid import ceil_div

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
BC = 64                     # keys a tile
TILE_BYTES = 64 * 128       # one tile: 64 rows of 128 bytes
BUF_BYTES = 2 * TILE_BYTES  # one buffer: K's tile and V's
SMEM_WORDS = BUF_BYTES // 2  # two buffers, in words
WG_ROWS = 64                # query rows a warpgroup
FWD_ROWS = 128              # two warpgroups a block
FWD_THREADS = 256
FWD_BLOCKS_PER_SM = 2        # <= 128 registers a thread: 16 warps an SM


# ---- the instructions -----------------------------------------------------------------------------------
@intrinsic
def wgmma_m64n64k16(typingctx, c, x, a0, a1, a2, a3, desc, accumulate, trans_b):
    """c[x..x+31] (this thread's 32 float32 of the warpgroup's 64 x 64 D) = A B (+ c[x..x+31] when accumulate):
    A (64 x 16 bf16) from registers a0..a3, B (16 x 64 bf16) from shared memory by descriptor desc (int64),
    K-major (trans_b = 0, a literal) or MN-major (1). Issued, not waited for: wgmma_commit, wgmma_wait."""
    if not (isinstance(c, types.Array) and c.ndim == 1 and isinstance(trans_b, types.IntegerLiteral)):
        return None
    tb = trans_b.literal_value
    sig = types.void(c, x, a0, a1, a2, a3, desc, accumulate, trans_b)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        base = builder.gep(arr.data, [context.cast(builder, args[1], sig.args[1], types.intp)], inbounds=True)
        slots = [builder.gep(base, [ir.Constant(_I64, i)], inbounds=True) for i in range(32)]
        words = [context.cast(builder, args[i], sig.args[i], types.uint32) for i in range(2, 6)]
        d = context.cast(builder, args[6], sig.args[6], types.int64)
        acc = context.cast(builder, args[7], sig.args[7], types.int32)
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 32), [_I32] * 4 + [_I64, _I32] + [_F32] * 32)
        regs = ",".join(f"${i}" for i in range(32))
        asm = ir.InlineAsm(fnty, "{\n.reg .pred p;\nsetp.ne.b32 p, $37, 0;\n"
                                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                                 f"{{{regs}}}, {{$32,$33,$34,$35}}, $36, p, 1, 1, {tb};\n}}",
                           ",".join(["=f"] * 32 + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(32)])
                           + ",~{memory}", side_effect=True)
        out = builder.call(asm, words + [d, acc] + [builder.load(s) for s in slots])
        for i, s in enumerate(slots):
            builder.store(builder.extract_value(out, i), s)
        return context.get_dummy_value()
    return sig, codegen


def _statement(text):
    """An intrinsic of no arguments that emits one PTX statement (ordered, a memory clobber)."""
    def stmt(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return types.void(), codegen
    return intrinsic(stmt)


wgmma_fence = _statement("wgmma.fence.sync.aligned;")           # before a product reads registers written since
wgmma_commit = _statement("wgmma.commit_group.sync.aligned;")   # the products issued so far: one group
wgmma_wait = _statement("wgmma.wait_group.sync.aligned 0;")     # every group done, D in the registers
fence_proxy_async = _statement("fence.proxy.async.shared::cta;")  # this thread's shared writes seen by wgmma


@cuda.jit(device=True, inline=True)
def smem_desc(addr, lbo, sbo):
    # the wgmma matrix descriptor (int64) of the 128-byte-swizzled tile at shared byte address addr: start
    # address, leading and stride byte offsets, each encoded (x & 0x3FFFF) >> 4, swizzle mode 1 (128 bytes)
    return (numba.int64((addr & 0x3FFFF) >> 4) | (numba.int64(lbo >> 4) << 16) | (numba.int64(sbo >> 4) << 32)
            | (numba.int64(1) << 62))


@cuda.jit(device=True, inline=True)
def copy_tile_sw128(dst, x, b, r0, w0, tid, nthreads):
    # shared tile at byte address dst (64 rows of 128 bytes, 128-byte swizzle) <- words w0..w0+32 of rows
    # r0..r0+64 of x[b], rows past T zero-filled: cp.async, 8 threads a row
    T, W = x.shape[1], x.shape[2]
    for i in range(512 // nthreads):
        r, c = tid // 8 + (nthreads // 8) * i, tid % 8
        row = r0 + r
        ok = row < T
        cp_async16(dst + 128 * r + 16 * (c ^ (r % 8)), x, (b * T + (row if ok else 0)) * W + w0 + 4 * c,
                   16 if ok else 0)


@cuda.jit(device=True, inline=True)
def wgmma_product(c, a, tile, trans_b):
    # The warpgroup's 64 x 64 product, waited for: A (64 x 64: 4 k-steps in registers a) with B, the swizzled
    # 64-row tile at shared byte address `tile`, into this thread's 32 floats c:
    #   trans_b = 0: C = A B^T (S = Q K^T), B's rows C's columns: K-major, k-step kk at +32 bytes
    #   trans_b = 1: C += A B (O += P V), B's rows the k axis: MN-major, k-step kk (16 rows) at +2048 bytes
    wgmma_fence()
    for kk in range(4):
        desc = smem_desc(tile + 2048 * kk, 8192, 1024) if trans_b else smem_desc(tile + 32 * kk, 16, 1024)
        wgmma_m64n64k16(c, 0, a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3], desc, trans_b or kk > 0,
                        trans_b)
    wgmma_commit()
    wgmma_wait()


# ---- the probe: one warpgroup, one product of each kind ----------------------------------------------------
@cuda.jit
def wgmma_probe_kernel(s_out, o_out, q, k, v, p):
    # One warpgroup (128 threads): s_out (64, 64) float32 = Q K^T and o_out (64, 64) = P V, with q, k, v, p
    # (1, 64, 32) uint32 (64 bf16 a row; P's rows as bf16 pairs). Q and P as A fragments in registers (warp
    # w: rows 16w..16w+15), K and V through 128-byte-swizzled shared tiles and descriptors. Overwrites both.
    tid = cuda.threadIdx.x
    lane, w0 = tid % 32, 16 * (tid // 32)
    smem = cuda.shared.array(4096, numba.uint32, alignment=1024)       # K's tile, then V's
    base = shared_address(smem, 0)
    copy_tile_sw128(base, k, 0, 0, 0, tid, 128)
    copy_tile_sw128(base + TILE_BYTES, v, 0, 0, 0, tid, 128)
    cp_async_commit()
    qf = cuda.local.array(16, numba.uint32)
    pf = cuda.local.array(16, numba.uint32)
    load_fragments(qf, 0, q, 0, w0, 0, lane)
    load_fragments(pf, 0, p, 0, w0, 0, lane)
    cp_async_wait(0)
    fence_proxy_async()
    cuda.syncthreads()
    s = cuda.local.array(32, numba.float32)
    o = cuda.local.array(32, numba.float32)
    for x in range(32):
        o[x] = 0.0
    wgmma_product(s, qf, base, 0)                   # S = Q K^T
    wgmma_product(o, pf, base + TILE_BYTES, 1)      # O += P V
    g, t = lane // 4, lane % 4
    for j in range(8):
        for e in range(4):
            s_out[w0 + g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = s[4 * j + e]
            o_out[w0 + g + 8 * (e // 2), 8 * j + 2 * t + e % 2] = o[4 * j + e]


# ---- version 12's forward ---------------------------------------------------------------------------------


@cuda.jit(device=True, inline=True)
def load_tiles_sw128(dst, x, wx, wy, b, r0, tid):
    # "Load K_j, V_j": rows r0..r0+BC of x's words wx.. (K) and wy.. (V) into the swizzled tiles at dst and
    # dst + TILE_BYTES; one cp.async group
    copy_tile_sw128(dst, x, b, r0, wx, tid, FWD_THREADS)
    copy_tile_sw128(dst + TILE_BYTES, x, b, r0, wy, tid, FWD_THREADS)
    cp_async_commit()




@cuda.jit(fastmath=True, **launch_bounds(FWD_THREADS, FWD_BLOCKS_PER_SM))
def flash_forward_wgmma_kernel(out, lse, inp, scale_log2):
    # As llmz.fast's flash_forward_mma_kernel (same arguments, same contract), the products on wgmma: block
    # (query tile of FWD_ROWS, h, b), the longest first; warpgroup x: rows r0 + 64x.., warp w: 16 of them.
    T, C2 = inp.shape[1], out.shape[2]
    tid, lane, h, b, r0, w0 = block_rows(FWD_ROWS, 16, True)
    g0 = r0 + WG_ROWS * (tid // 128)            # the warpgroup's first row
    hq, hk, hv = h * WORDS, C2 + h * WORDS, 2 * C2 + h * WORDS
    smem = cuda.shared.array(SMEM_WORDS, numba.uint32, alignment=1024)     # buffer n: K, V tiles
    base = shared_address(smem, 0)
    nkt = (min(r0 + FWD_ROWS, T) - 1) // BC + 1
    load_tiles_sw128(base, inp, hk, hv, b, 0, tid)
    qf = cuda.local.array(16, numba.uint32)     # Q_i as A fragments (the warp's 16 rows)
    o = cuda.local.array(32, numba.float32)
    s = cuda.local.array(32, numba.float32)
    pf = cuda.local.array(16, numba.uint32)
    m = cuda.local.array(2, numba.float32)
    l = cuda.local.array(2, numba.float32)
    load_fragments(qf, 0, inp, b, w0, hq, lane)
    for x in range(32):
        o[x] = 0.0
    m[0], m[1], l[0], l[1] = NEG, NEG, 0.0, 0.0
    for kt in range(nkt):
        cp_async_wait(0)
        fence_proxy_async()
        cuda.syncthreads()                      # tile kt is in, for every thread and the tensor cores
        if kt + 1 < nkt:
            load_tiles_sw128(base + (kt + 1) % 2 * BUF_BYTES, inp, hk, hv, b, (kt + 1) * BC, tid)
        k0, tile = kt * BC, base + kt % 2 * BUF_BYTES
        if k0 < g0 + WG_ROWS:                   # the warpgroup's rows meet the tile (uniform in a warpgroup)
            wgmma_product(s, qf, tile, 0)                                 # S = Q K^T
            if k0 + BC - 1 > w0:
                causal_mask(s, 0, w0, k0, lane, T, False, NEG)
            online_softmax(s, o, m, l, 1, scale_log2)                     # m, P~, l; O rescaled
            pack_a(pf, s, 1)
            wgmma_product(o, pf, tile + TILE_BYTES, 1)                    # O += P~ V
    write_o_lse(out, lse, o, m, l, 0, b, h, w0, hq, lane, scale_log2)


def flash_attention_forward_wgmma(dev, out, lse, inp, num_heads) -> None:
    """As llmz.fast.flash_attention.flash_attention_forward_fast, on flash_forward_wgmma_kernel."""
    B, T, _ = inp.shape
    dev.launch(flash_forward_wgmma_kernel, (ceil_div(T, FWD_ROWS), num_heads, B), FWD_THREADS, pair_view(out),
               lse, pair_view(inp), fa.SCALE * fa.LOG2E, flops=fa.causal_flops(B, num_heads, T, 2))


def probe() -> int:
    """wgmma_probe_kernel on fresh random bf16 Q, K, V, P against float64 Q K^T and P V: one line each; 0 if
    both agree to float32 sums of exact bf16 products (max error < 1e-5 of the max)."""
    from llmz.bf16 import bf16_to_f32, f32_to_bf16
    rng = np.random.default_rng()
    q, k, v, p = (f32_to_bf16(rng.normal(size=(64, 64))) for _ in range(4))
    s_out, o_out = cuda.device_array((64, 64), np.float32), cuda.device_array((64, 64), np.float32)
    words = (cuda.to_device(np.ascontiguousarray(x).view(np.uint32).reshape(1, 64, 32)) for x in (q, k, v, p))
    wgmma_probe_kernel[1, 128](s_out, o_out, *words)
    Q, K, V, P = (bf16_to_f32(x).astype(np.float64) for x in (q, k, v, p))
    ok = True
    for what, got, want in (("S = Q K^T (K-major B)", s_out.copy_to_host(), Q @ K.T),
                            ("O = P V (MN-major B)", o_out.copy_to_host(), P @ V)):
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        ok &= err < 1e-5
        print(f"wgmma probe, {what}: max error / max = {err:.1e} {'PASS' if err < 1e-5 else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(probe())
