"""Version 1 of dev/flash_attention.py: the first tensor-core flash attention (llmz.fast's until the
promotion of versions 5's forward and 4's backward), kept here as the history's first row.

Its layout: blocks of 4 warps own 64 rows (16 a warp); each K/V (Q/dO) tile of 64 rows goes global ->
registers -> shared memory a word at a time (stage_rows; stage_transposed writes the transposed copy a B
fragment of O += P V, dq += dS K, dv += P^T dO, dk += dS^T Q wants, key pairs in a word), behind the branch of
the row check, so the loads of a tile go out one after another; fragments are read one word a lane
(load_at, LDS.32). One shared buffer: two syncthreads a tile, nothing to overlap the copies with the mmas.
Helpers, constants and the contract are llmz.fast.flash_attention's.
"""
import math

import numba
from numba import cuda

from llmz.device import ceil_div
from llmz.fast.device_helpers import pair_view
from llmz.fast.flash_attention import (
    FULL,
    HI16,
    LO16,
    LOG2E,
    NEG,
    ONE,
    PAD,
    S16,
    SCALE,
    WORDS,
    ZERO,
    bf16_hi,
    bf16_lo,
    causal_flops,
    launch_bounds,
    store_pair,
)
from llmz.fast.mma import load_at, pack_bf16x2, store_at
from llmz.fast.mma import mma_m16n8k16_bf16 as mma

TILE = 64                   # rows of a block's tile and of the other operand's tiles
WARPS = 4                   # warp w owns rows 16w..16w+15 of the block's tile
THREADS = 32 * WARPS
TILE_WORDS = TILE * PAD     # a shared tile (TILE rows, or HS rows when transposed: HS = TILE), 1-D


# ---- staging tiles into shared memory ------------------------------------
@cuda.jit(device=True, inline=True)
def stage_rows(tile, x, b, r0, w0, T, tid):
    # tile (TILE * PAD words, row-major) <- words w0 .. w0+WORDS of rows r0 .. r0+TILE of x[b] (0 past row T).
    # Warp w copies rows w, w+4, ..., lane l word l: each row one coalesced 128-byte read.
    warp, lane = tid // 32, tid % 32
    for i in range(TILE // WARPS):
        r = r0 + warp + WARPS * i
        store_at(tile, warp * PAD + lane, WARPS * i * PAD, x[b, r, w0 + lane] if r < T else ZERO)


@cuda.jit(device=True, inline=True)
def stage_transposed(tile, x, b, r0, w0, T, tid):
    # tile (HS * PAD words): the same rows transposed, word [c, p] = (x's channel c at rows r0+2p, r0+2p+1),
    # the key (or query) pairs an mma B fragment holds. Warp w takes words 8w..8w+7 of the row pairs.
    lane = tid % 32
    w = 8 * (tid // 32) + lane % 8
    base = 2 * w * PAD + lane // 8
    for i in range(TILE // 8):
        r = r0 + 2 * (4 * i + lane // 8)
        x0 = x[b, r, w0 + w] if r < T else ZERO
        x1 = x[b, r + 1, w0 + w] if r + 1 < T else ZERO
        store_at(tile, base, 4 * i, (x0 & LO16) | (x1 << S16))
        store_at(tile, base, PAD + 4 * i, (x0 >> S16) | (x1 & HI16))


# ---- forward ---------------------------------------------------------------------------------------
@cuda.jit(fastmath=True)
def flash_forward_mma_kernel(out, lse, inp, scale_log2):
    # out (B,T,C/2), inp (B,T,3C/2) words; lse (B,NH,T) float32. Block (query tile, h, b), the longest rows
    # (last query tile) first. Overwrites out and lse.
    T, C2 = inp.shape[1], out.shape[2]
    qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    fb = g * PAD + t                            # the lane's word in a shared tile's fragment
    ra = qt * TILE + 16 * warp + g              # the lane's two rows
    rb = ra + 8
    hq = h * WORDS
    k_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    vt_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    # Q as A fragments, 4 k-steps of 16 channels, for the whole kernel
    qf = cuda.local.array(16, numba.uint32)
    for kk in range(4):
        qf[4 * kk] = inp[b, ra, hq + 8 * kk + t] if ra < T else ZERO
        qf[4 * kk + 1] = inp[b, rb, hq + 8 * kk + t] if rb < T else ZERO
        qf[4 * kk + 2] = inp[b, ra, hq + 8 * kk + 4 + t] if ra < T else ZERO
        qf[4 * kk + 3] = inp[b, rb, hq + 8 * kk + 4 + t] if rb < T else ZERO
    o = cuda.local.array(32, numba.float32)     # O: rows ra, rb x channels 8j+2t, 8j+2t+1
    s = cuda.local.array(32, numba.float32)     # S, then P: rows ra, rb x keys 8j+2t, 8j+2t+1
    pf = cuda.local.array(16, numba.uint32)     # P as bf16 A fragments
    for i in range(32):
        o[i] = 0.0
    ma = numba.float32(NEG)                     # running max (raw scores) and sum of the two rows
    mb = numba.float32(NEG)
    la = numba.float32(0.0)
    lb = numba.float32(0.0)
    for kt in range(qt + 1):
        k0 = kt * TILE
        cuda.syncthreads()                      # the previous tile is consumed
        stage_rows(k_s, inp, b, k0, C2 + hq, T, tid)
        stage_transposed(vt_s, inp, b, k0, 2 * C2 + hq, T, tid)
        cuda.syncthreads()
        # S = Q K^T: 8 n-tiles of 8 keys, 4 k-steps
        for i in range(32):
            s[i] = 0.0
        for kk in range(4):
            for j in range(8):
                s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                    qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3],
                    load_at(k_s, fb, 8 * j * PAD + 8 * kk), load_at(k_s, fb, 8 * j * PAD + 8 * kk + 4),
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
        # the causal mask, on the diagonal tile only (keys past T are past every row < T too)
        if kt == qt:
            for j in range(8):
                u = k0 + 8 * j + 2 * t
                if u > ra:
                    s[4 * j] = NEG
                if u + 1 > ra:
                    s[4 * j + 1] = NEG
                if u > rb:
                    s[4 * j + 2] = NEG
                if u + 1 > rb:
                    s[4 * j + 3] = NEG
        # the new running max of each row: the lane's 16 scores, then the row's 4 lanes
        xa, xb = ma, mb
        for j in range(8):
            xa = max(xa, max(s[4 * j], s[4 * j + 1]))
            xb = max(xb, max(s[4 * j + 2], s[4 * j + 3]))
        xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 1))
        xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 2))
        xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 1))
        xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 2))
        # rescale the sums and O to the new max
        alpha_a = math.exp2((ma - xa) * scale_log2)
        alpha_b = math.exp2((mb - xb) * scale_log2)
        ma, mb = xa, xb
        la *= alpha_a
        lb *= alpha_b
        for j in range(8):
            o[4 * j] *= alpha_a
            o[4 * j + 1] *= alpha_a
            o[4 * j + 2] *= alpha_b
            o[4 * j + 3] *= alpha_b
        # P = exp(scale * (S - max)); the lane's part of the row sums
        sa, sb = ma * scale_log2, mb * scale_log2
        for j in range(8):
            s[4 * j] = math.exp2(s[4 * j] * scale_log2 - sa)
            s[4 * j + 1] = math.exp2(s[4 * j + 1] * scale_log2 - sa)
            s[4 * j + 2] = math.exp2(s[4 * j + 2] * scale_log2 - sb)
            s[4 * j + 3] = math.exp2(s[4 * j + 3] * scale_log2 - sb)
            la += s[4 * j] + s[4 * j + 1]
            lb += s[4 * j + 2] + s[4 * j + 3]
        # P as bf16 A fragments (two C tiles of 8 keys = one A fragment of 16), then O += P V
        for kk in range(4):
            pf[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
            pf[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
            pf[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
            pf[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
        for kk in range(4):
            for j in range(8):
                o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3] = mma(
                    pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3],
                    load_at(vt_s, fb, 8 * j * PAD + 8 * kk), load_at(vt_s, fb, 8 * j * PAD + 8 * kk + 4),
                    o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3])
    # the row sums over the row's 4 lanes; out = O / l; lse = scale * max + log(l)
    la += cuda.shfl_xor_sync(FULL, la, 1)
    la += cuda.shfl_xor_sync(FULL, la, 2)
    lb += cuda.shfl_xor_sync(FULL, lb, 1)
    lb += cuda.shfl_xor_sync(FULL, lb, 2)
    ia, ib = ONE / la, ONE / lb
    for j in range(8):
        if ra < T:
            out[b, ra, hq + 4 * j + t] = pack_bf16x2(o[4 * j] * ia, o[4 * j + 1] * ia)
        if rb < T:
            out[b, rb, hq + 4 * j + t] = pack_bf16x2(o[4 * j + 2] * ib, o[4 * j + 3] * ib)
    if t == 0 and ra < T:
        lse[b, h, ra] = (ma * scale_log2 + math.log2(la)) / LOG2E
    if t == 0 and rb < T:
        lse[b, h, rb] = (mb * scale_log2 + math.log2(lb)) / LOG2E


# ---- backward --------------------------------------------------------------------------------------
@cuda.jit
def flash_rowsum_kernel(dsum, dout, out):
    # dsum (B,NH,T) float32; dout, out (B,T,C/2) words. dsum[b,h,t] = dout[b,t,h] . out[b,t,h] (float32 sum in
    # channel order). One thread per (b,t,h). Overwrites dsum.
    B, NH, T = dsum.shape
    idx = cuda.grid(1)
    if idx < B * T * NH:
        h = idx % NH
        t = idx // NH % T
        b = idx // (NH * T)
        acc = numba.float32(0.0)
        for w in range(h * WORDS, (h + 1) * WORDS):
            x, y = dout[b, t, w], out[b, t, w]
            acc += bf16_lo(x) * bf16_lo(y)
            acc += bf16_hi(x) * bf16_hi(y)
        dsum[b, h, t] = acc


# dq's kernel asks ptxas for 3 blocks an SM (<= 168 registers: 8 bytes spilled, against 184 registers and 2
# blocks without the bound); dk/dv's stays at 231 registers and 2 blocks (bounded to 3 it spilled 332 bytes).
DQ_BLOCKS_PER_SM = 3


@cuda.jit(fastmath=True, **launch_bounds(THREADS, DQ_BLOCKS_PER_SM))
def flash_dq_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # dinp, inp (B,T,3C/2), dout (B,T,C/2) words; lse, dsum (B,NH,T) float32. Block (query tile, h, b):
    # dq_t = scale * sum over keys u <= t of dS[t,u] k_u, key tiles in order up to the diagonal.
    # (+)= into dinp's q part (accumulate=False: overwrites).
    T, C2 = inp.shape[1], dout.shape[2]
    qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    fb = g * PAD + t                            # the lane's word in a shared tile's fragment
    ra = qt * TILE + 16 * warp + g
    rb = ra + 8
    hq = h * WORDS
    k_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    kt_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    v_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    # Q and dO as A fragments; the rows' lse (log2 units) and D
    qf = cuda.local.array(16, numba.uint32)
    dof = cuda.local.array(16, numba.uint32)
    for kk in range(4):
        qf[4 * kk] = inp[b, ra, hq + 8 * kk + t] if ra < T else ZERO
        qf[4 * kk + 1] = inp[b, rb, hq + 8 * kk + t] if rb < T else ZERO
        qf[4 * kk + 2] = inp[b, ra, hq + 8 * kk + 4 + t] if ra < T else ZERO
        qf[4 * kk + 3] = inp[b, rb, hq + 8 * kk + 4 + t] if rb < T else ZERO
        dof[4 * kk] = dout[b, ra, hq + 8 * kk + t] if ra < T else ZERO
        dof[4 * kk + 1] = dout[b, rb, hq + 8 * kk + t] if rb < T else ZERO
        dof[4 * kk + 2] = dout[b, ra, hq + 8 * kk + 4 + t] if ra < T else ZERO
        dof[4 * kk + 3] = dout[b, rb, hq + 8 * kk + 4 + t] if rb < T else ZERO
    la = lse[b, h, ra] * LOG2E if ra < T else numba.float32(0.0)
    lb = lse[b, h, rb] * LOG2E if rb < T else numba.float32(0.0)
    da = dsum[b, h, ra] if ra < T else numba.float32(0.0)
    db = dsum[b, h, rb] if rb < T else numba.float32(0.0)
    dq = cuda.local.array(32, numba.float32)
    s = cuda.local.array(32, numba.float32)     # S, then P, then dS
    dp = cuda.local.array(32, numba.float32)
    pf = cuda.local.array(16, numba.uint32)
    for i in range(32):
        dq[i] = 0.0
    for kt in range(qt + 1):
        k0 = kt * TILE
        cuda.syncthreads()
        stage_rows(k_s, inp, b, k0, C2 + hq, T, tid)
        stage_transposed(kt_s, inp, b, k0, C2 + hq, T, tid)
        stage_rows(v_s, inp, b, k0, 2 * C2 + hq, T, tid)
        cuda.syncthreads()
        # S = Q K^T and dP = dO V^T
        for i in range(32):
            s[i] = 0.0
            dp[i] = 0.0
        for kk in range(4):
            for j in range(8):
                s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                    qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3],
                    load_at(k_s, fb, 8 * j * PAD + 8 * kk), load_at(k_s, fb, 8 * j * PAD + 8 * kk + 4),
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3] = mma(
                    dof[4 * kk], dof[4 * kk + 1], dof[4 * kk + 2], dof[4 * kk + 3],
                    load_at(v_s, fb, 8 * j * PAD + 8 * kk), load_at(v_s, fb, 8 * j * PAD + 8 * kk + 4),
                    dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3])
        # P = exp(scale * S - lse), 0 above the diagonal; dS = P (dP - D)
        for j in range(8):
            u = k0 + 8 * j + 2 * t
            p0 = math.exp2(s[4 * j] * scale_log2 - la)
            p1 = math.exp2(s[4 * j + 1] * scale_log2 - la)
            p2 = math.exp2(s[4 * j + 2] * scale_log2 - lb)
            p3 = math.exp2(s[4 * j + 3] * scale_log2 - lb)
            if kt == qt:
                p0 = p0 if u <= ra else numba.float32(0.0)
                p1 = p1 if u + 1 <= ra else numba.float32(0.0)
                p2 = p2 if u <= rb else numba.float32(0.0)
                p3 = p3 if u + 1 <= rb else numba.float32(0.0)
            s[4 * j] = p0 * (dp[4 * j] - da)
            s[4 * j + 1] = p1 * (dp[4 * j + 1] - da)
            s[4 * j + 2] = p2 * (dp[4 * j + 2] - db)
            s[4 * j + 3] = p3 * (dp[4 * j + 3] - db)
        # dq += dS K: dS as bf16 A fragments, K (keys x channels) from its transposed tile
        for kk in range(4):
            pf[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
            pf[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
            pf[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
            pf[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
        for kk in range(4):
            for j in range(8):
                dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3] = mma(
                    pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3],
                    load_at(kt_s, fb, 8 * j * PAD + 8 * kk), load_at(kt_s, fb, 8 * j * PAD + 8 * kk + 4),
                    dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3])
    for j in range(8):
        if ra < T:
            store_pair(dinp, b, ra, hq + 4 * j + t, dq[4 * j] * scale, dq[4 * j + 1] * scale, accumulate)
        if rb < T:
            store_pair(dinp, b, rb, hq + 4 * j + t, dq[4 * j + 2] * scale, dq[4 * j + 3] * scale, accumulate)


@cuda.jit(fastmath=True)
def flash_dkv_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # As flash_dq_mma_kernel for dk and dv: block (key tile, h, b), the longest (first key tile) first; the
    # lane's rows are keys ka, kb; query tiles in order from the diagonal to the last:
    #   S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D)
    #   dv += P^T dO, dk += scale dS^T Q.   (+)= into dinp's k and v parts (accumulate=False: overwrites).
    T, C2 = inp.shape[1], dout.shape[2]
    ntiles = cuda.gridDim.x
    kt = cuda.blockIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    fb = g * PAD + t                            # the lane's word in a shared tile's fragment
    ka = kt * TILE + 16 * warp + g
    kb = ka + 8
    hq = h * WORDS
    hk, hv = C2 + hq, 2 * C2 + hq
    q_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    qt_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    do_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    dot_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    lse_s = cuda.shared.array(TILE, numba.float32)
    d_s = cuda.shared.array(TILE, numba.float32)
    # K and V as A fragments
    kf = cuda.local.array(16, numba.uint32)
    vf = cuda.local.array(16, numba.uint32)
    for kk in range(4):
        kf[4 * kk] = inp[b, ka, hk + 8 * kk + t] if ka < T else ZERO
        kf[4 * kk + 1] = inp[b, kb, hk + 8 * kk + t] if kb < T else ZERO
        kf[4 * kk + 2] = inp[b, ka, hk + 8 * kk + 4 + t] if ka < T else ZERO
        kf[4 * kk + 3] = inp[b, kb, hk + 8 * kk + 4 + t] if kb < T else ZERO
        vf[4 * kk] = inp[b, ka, hv + 8 * kk + t] if ka < T else ZERO
        vf[4 * kk + 1] = inp[b, kb, hv + 8 * kk + t] if kb < T else ZERO
        vf[4 * kk + 2] = inp[b, ka, hv + 8 * kk + 4 + t] if ka < T else ZERO
        vf[4 * kk + 3] = inp[b, kb, hv + 8 * kk + 4 + t] if kb < T else ZERO
    dk = cuda.local.array(32, numba.float32)
    dv = cuda.local.array(32, numba.float32)
    s = cuda.local.array(32, numba.float32)     # S^T, then P^T
    dp = cuda.local.array(32, numba.float32)    # dP^T, then dS^T
    pf = cuda.local.array(16, numba.uint32)
    for i in range(32):
        dk[i] = 0.0
        dv[i] = 0.0
    for qt in range(kt, ntiles):
        q0 = qt * TILE
        cuda.syncthreads()
        stage_rows(q_s, inp, b, q0, hq, T, tid)
        stage_transposed(qt_s, inp, b, q0, hq, T, tid)
        stage_rows(do_s, dout, b, q0, hq, T, tid)
        stage_transposed(dot_s, dout, b, q0, hq, T, tid)
        if tid < TILE:
            lse_s[tid] = lse[b, h, q0 + tid] * LOG2E if q0 + tid < T else numba.float32(0.0)
            d_s[tid] = dsum[b, h, q0 + tid] if q0 + tid < T else numba.float32(0.0)
        cuda.syncthreads()
        # S^T = K Q^T and dP^T = V dO^T: 8 n-tiles of 8 queries
        for i in range(32):
            s[i] = 0.0
            dp[i] = 0.0
        for kk in range(4):
            for j in range(8):
                s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                    kf[4 * kk], kf[4 * kk + 1], kf[4 * kk + 2], kf[4 * kk + 3],
                    load_at(q_s, fb, 8 * j * PAD + 8 * kk), load_at(q_s, fb, 8 * j * PAD + 8 * kk + 4),
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3] = mma(
                    vf[4 * kk], vf[4 * kk + 1], vf[4 * kk + 2], vf[4 * kk + 3],
                    load_at(do_s, fb, 8 * j * PAD + 8 * kk), load_at(do_s, fb, 8 * j * PAD + 8 * kk + 4),
                    dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3])
        # P^T = exp(scale * S^T - lse[query]), 0 where query < key (diagonal tile) or query >= T (last
        # tile); dS^T = P^T (dP^T - D[query])
        masked = qt == kt or q0 + TILE > T
        for j in range(8):
            c = 8 * j + 2 * t                   # the lane's two queries: q0 + c, q0 + c + 1
            l0, l1 = load_at(lse_s, 2 * t, 8 * j), load_at(lse_s, 2 * t, 8 * j + 1)
            p0 = math.exp2(s[4 * j] * scale_log2 - l0)
            p1 = math.exp2(s[4 * j + 1] * scale_log2 - l1)
            p2 = math.exp2(s[4 * j + 2] * scale_log2 - l0)
            p3 = math.exp2(s[4 * j + 3] * scale_log2 - l1)
            if masked:
                u = q0 + c
                p0 = p0 if ka <= u < T else numba.float32(0.0)
                p1 = p1 if ka <= u + 1 < T else numba.float32(0.0)
                p2 = p2 if kb <= u < T else numba.float32(0.0)
                p3 = p3 if kb <= u + 1 < T else numba.float32(0.0)
            s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = p0, p1, p2, p3
            d0, d1 = load_at(d_s, 2 * t, 8 * j), load_at(d_s, 2 * t, 8 * j + 1)
            dp[4 * j] = p0 * (dp[4 * j] - d0)
            dp[4 * j + 1] = p1 * (dp[4 * j + 1] - d1)
            dp[4 * j + 2] = p2 * (dp[4 * j + 2] - d0)
            dp[4 * j + 3] = p3 * (dp[4 * j + 3] - d1)
        # dv += P^T dO: P^T as bf16 A fragments, dO (queries x channels) from its transposed tile
        for kk in range(4):
            pf[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
            pf[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
            pf[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
            pf[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
        for kk in range(4):
            for j in range(8):
                dv[4 * j], dv[4 * j + 1], dv[4 * j + 2], dv[4 * j + 3] = mma(
                    pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3],
                    load_at(dot_s, fb, 8 * j * PAD + 8 * kk), load_at(dot_s, fb, 8 * j * PAD + 8 * kk + 4),
                    dv[4 * j], dv[4 * j + 1], dv[4 * j + 2], dv[4 * j + 3])
        # dk += dS^T Q
        for kk in range(4):
            pf[4 * kk] = pack_bf16x2(dp[8 * kk], dp[8 * kk + 1])
            pf[4 * kk + 1] = pack_bf16x2(dp[8 * kk + 2], dp[8 * kk + 3])
            pf[4 * kk + 2] = pack_bf16x2(dp[8 * kk + 4], dp[8 * kk + 5])
            pf[4 * kk + 3] = pack_bf16x2(dp[8 * kk + 6], dp[8 * kk + 7])
        for kk in range(4):
            for j in range(8):
                dk[4 * j], dk[4 * j + 1], dk[4 * j + 2], dk[4 * j + 3] = mma(
                    pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3],
                    load_at(qt_s, fb, 8 * j * PAD + 8 * kk), load_at(qt_s, fb, 8 * j * PAD + 8 * kk + 4),
                    dk[4 * j], dk[4 * j + 1], dk[4 * j + 2], dk[4 * j + 3])
    for j in range(8):
        if ka < T:
            store_pair(dinp, b, ka, hk + 4 * j + t, dk[4 * j] * scale, dk[4 * j + 1] * scale, accumulate)
            store_pair(dinp, b, ka, hv + 4 * j + t, dv[4 * j], dv[4 * j + 1], accumulate)
        if kb < T:
            store_pair(dinp, b, kb, hk + 4 * j + t, dk[4 * j + 2] * scale, dk[4 * j + 3] * scale, accumulate)
            store_pair(dinp, b, kb, hv + 4 * j + t, dv[4 * j + 2], dv[4 * j + 3], accumulate)


# ---- the launches (arguments as llmz.fast.flash_attention's) ---------------------------------------------
def flash_attention_forward_v1(dev, out, lse, inp, num_heads) -> None:
    B, T, _ = inp.shape
    dev.launch(flash_forward_mma_kernel, (ceil_div(T, TILE), num_heads, B), THREADS,
               pair_view(out), lse, pair_view(inp), SCALE * LOG2E, flops=causal_flops(B, num_heads, T, 2))


def flash_attention_backward_v1(dev, dinp, dout, inp, out, lse, dsum, num_heads, accumulate=True) -> None:
    B, T, _ = inp.shape
    dout2, inp2, dinp2 = pair_view(dout), pair_view(inp), pair_view(dinp)
    dev.launch(flash_rowsum_kernel, ceil_div(B * T * num_heads, 256), 256, dsum, dout2, pair_view(out))
    grid = (ceil_div(T, TILE), num_heads, B)
    dev.launch(flash_dkv_mma_kernel, grid, THREADS, dinp2, dout2, inp2, lse, dsum, SCALE * LOG2E, SCALE,
               accumulate, flops=causal_flops(B, num_heads, T, 4))
    dev.launch(flash_dq_mma_kernel, grid, THREADS, dinp2, dout2, inp2, lse, dsum, SCALE * LOG2E, SCALE,
               accumulate, flops=causal_flops(B, num_heads, T, 3))
