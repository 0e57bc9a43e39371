"""Version 1 of dev/flash_attention.py: the first tensor-core flash attention (llmz.fast's until the
promotion of versions 5's forward and 4's backward), kept here as the history's first row.

Its layout: blocks of 4 warps own 64 rows (16 a warp); each K/V (Q/dO) tile of 64 rows goes global ->
registers -> shared memory a word at a time (stage_rows; stage_transposed writes the transposed copy a B
fragment of O += P V, dq += dS K, dv += P^T dO, dk += dS^T Q wants, key pairs in a word), behind the branch of
the row check, so the loads of a tile go out one after another; fragments are read one word a lane
(load_at, LDS.32). One shared buffer: two syncthreads a tile, nothing to overlap the copies with the mmas.
The FlashAttention-2 steps (the device functions), constants and the contract are llmz.fast.flash_attention's;
only the staging and the one-word-a-lane products (mma_words) are version 1's own.
"""

import numba
from numba import cuda

from llmz.fast.device_helpers import pair_view
from llmz.fast.flash_attention import (
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
    ZERO_F,
    bf16_hi,
    bf16_lo,
    block_rows,
    causal_flops,
    causal_mask,
    compute_ds,
    launch_bounds,
    load_fragments,
    load_query_rows,
    mma_tile,
    online_softmax,
    pack_a,
    recompute_p,
    row_stats,
    store_rows,
    write_o_lse,
)
from llmz.fast.mma import load_at, store_at
from llmz.kernels.grid import ceil_div

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


# ---- the products: B fragments one word a lane -----------------------------------------------------------
@cuda.jit(device=True, inline=True)
def mma_words(c, a, tile, fb):
    # C += A B for one row tile: A (16 x 64) in a (4 k-steps); B^T (8 n-tiles x 64 k) stored row-major in the
    # shared `tile` (K's rows for S = Q K^T; a transposed copy, key pairs in a word, for O += P V): lane 4g+t
    # reads b[0], b[1] of n-tile j, k-step kk at words 8kk+t and 8kk+4+t of row 8j+g (fb = g*PAD + t)
    for kk in range(4):
        for j in range(8):
            mma_tile(c, 4 * j, a, 4 * kk, load_at(tile, fb, 8 * j * PAD + 8 * kk),
                     load_at(tile, fb, 8 * j * PAD + 8 * kk + 4))


@cuda.jit(device=True, inline=True)
def zero(c):
    for x in range(32):
        c[x] = 0.0


# ---- forward ---------------------------------------------------------------------------------------
@cuda.jit(fastmath=True)
def flash_forward_mma_kernel(out, lse, inp, scale_log2):
    # out (B,T,C/2), inp (B,T,3C/2) words; lse (B,NH,T) float32. Block (query tile, h, b), the longest rows
    # (last query tile) first. Overwrites out and lse.
    T, C2 = inp.shape[1], out.shape[2]
    tid, lane, h, b, r0, w0 = block_rows(TILE, 16, True)
    fb = lane // 4 * PAD + lane % 4             # the lane's word in a shared tile's fragment
    hq = h * WORDS
    k_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    vt_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    qf = cuda.local.array(16, numba.uint32)     # Q as A fragments, for the whole kernel
    load_fragments(qf, 0, inp, b, w0, hq, lane)
    o = cuda.local.array(32, numba.float32)     # O: rows g, g+8 x channels 8j+2t, 8j+2t+1
    s = cuda.local.array(32, numba.float32)     # S, then P~: rows g, g+8 x keys 8j+2t, 8j+2t+1
    pf = cuda.local.array(16, numba.uint32)     # P~ as bf16 A fragments
    m = cuda.local.array(2, numba.float32)      # running max (raw scores) and sum of the two rows
    l = cuda.local.array(2, numba.float32)
    zero(o)
    m[0], m[1], l[0], l[1] = NEG, NEG, 0.0, 0.0
    for kt in range(r0 // TILE + 1):
        k0 = kt * TILE
        cuda.syncthreads()                      # the previous tile is consumed
        stage_rows(k_s, inp, b, k0, C2 + hq, T, tid)
        stage_transposed(vt_s, inp, b, k0, 2 * C2 + hq, T, tid)
        cuda.syncthreads()
        zero(s)
        mma_words(s, qf, k_s, fb)                                       # S = Q K^T
        if k0 + TILE - 1 > w0:                  # the causal mask, on the diagonal tile only
            causal_mask(s, 0, w0, k0, lane, T, False, NEG)
        online_softmax(s, o, m, l, 1, scale_log2)                       # m, P~, l; O rescaled
        pack_a(pf, s, 1)
        mma_words(o, pf, vt_s, fb)                                      # O += P~ V
    write_o_lse(out, lse, o, m, l, 0, b, h, w0, hq, lane, scale_log2)


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
    tid, lane, h, b, r0, w0 = block_rows(TILE, 16, True)
    fb = lane // 4 * PAD + lane % 4
    hq = h * WORDS
    k_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    kt_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    v_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    qf = cuda.local.array(16, numba.uint32)     # Q and dO as A fragments; the rows' lse (log2 units) and D
    dof = cuda.local.array(16, numba.uint32)
    la, lb, da, db = load_query_rows(qf, dof, inp, dout, lse, dsum, b, h, w0, lane)
    dq = cuda.local.array(32, numba.float32)
    s = cuda.local.array(32, numba.float32)     # S, then P
    dp = cuda.local.array(32, numba.float32)    # dP, then dS
    pf = cuda.local.array(16, numba.uint32)
    zero(dq)
    for kt in range(r0 // TILE + 1):
        k0 = kt * TILE
        cuda.syncthreads()
        stage_rows(k_s, inp, b, k0, C2 + hq, T, tid)
        stage_transposed(kt_s, inp, b, k0, C2 + hq, T, tid)
        stage_rows(v_s, inp, b, k0, 2 * C2 + hq, T, tid)
        cuda.syncthreads()
        zero(s)
        zero(dp)
        mma_words(s, qf, k_s, fb)                                       # S = Q K^T
        mma_words(dp, dof, v_s, fb)                                     # dP = dO V^T
        for j in range(8):
            recompute_p(s, 4 * j, la, lb, False, scale_log2)            # P = exp(S - L)
        if kt == r0 // TILE:                    # the diagonal tile
            causal_mask(s, 0, w0, k0, lane, T, False, ZERO_F)
        for j in range(8):
            compute_ds(dp, s, 4 * j, da, db, False)                     # dS = P o (dP - D)
        pack_a(pf, dp, 1)
        mma_words(dq, pf, kt_s, fb)                                     # dQ += dS K
    store_rows(dinp, b, w0, hq, dq, 0, scale, scale, accumulate, lane)


@cuda.jit(fastmath=True)
def flash_dkv_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # As flash_dq_mma_kernel for dk and dv: block (key tile, h, b), the longest (first key tile) first; the
    # lane's rows are keys; query tiles in order from the diagonal to the last:
    #   S^T = K Q^T, P^T = exp(S^T - L), dP^T = V dO^T, dS^T = P^T o (dP^T - D), dV += P^T dO, dK += scale dS^T Q
    # (+)= into dinp's k and v parts (accumulate=False: overwrites).
    T, C2 = inp.shape[1], dout.shape[2]
    tid, lane, h, b, r0, w0 = block_rows(TILE, 16, False)
    fb = lane // 4 * PAD + lane % 4
    hq = h * WORDS
    hk, hv = C2 + hq, 2 * C2 + hq
    q_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    qt_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    do_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    dot_s = cuda.shared.array(TILE_WORDS, numba.uint32)
    lse_s = cuda.shared.array(TILE, numba.float32)
    d_s = cuda.shared.array(TILE, numba.float32)
    dk = cuda.local.array(32, numba.float32)
    dv = cuda.local.array(32, numba.float32)
    zero(dk)
    zero(dv)
    s = cuda.local.array(32, numba.float32)     # S^T, then P^T
    dp = cuda.local.array(32, numba.float32)    # dP^T, then dS^T
    pf = cuda.local.array(16, numba.uint32)
    kf = cuda.local.array(16, numba.uint32)     # K and V as A fragments
    vf = cuda.local.array(16, numba.uint32)
    load_fragments(kf, 0, inp, b, w0, hk, lane)
    load_fragments(vf, 0, inp, b, w0, hv, lane)
    t2 = 2 * (lane % 4)                         # the lane's first column in an n-tile
    for qt in range(r0 // TILE, cuda.gridDim.x):
        q0 = qt * TILE
        cuda.syncthreads()
        stage_rows(q_s, inp, b, q0, hq, T, tid)
        stage_transposed(qt_s, inp, b, q0, hq, T, tid)
        stage_rows(do_s, dout, b, q0, hq, T, tid)
        stage_transposed(dot_s, dout, b, q0, hq, T, tid)
        if tid < TILE:
            lse_s[tid], d_s[tid] = row_stats(lse, dsum, b, h, q0 + tid)
        cuda.syncthreads()
        zero(s)
        zero(dp)
        mma_words(s, kf, q_s, fb)                                       # S^T = K Q^T
        mma_words(dp, vf, do_s, fb)                                     # dP^T = V dO^T
        for j in range(8):                      # P^T = exp(S^T - L), L of the columns' queries
            recompute_p(s, 4 * j, load_at(lse_s, t2, 8 * j), load_at(lse_s, t2, 8 * j + 1), True, scale_log2)
        if q0 < w0 + 15 or q0 + TILE > T:       # the diagonal tile, the last (partial) tile
            causal_mask(s, 0, w0, q0, lane, T, True, ZERO_F)
        for j in range(8):                      # dS^T = P^T o (dP^T - D)
            compute_ds(dp, s, 4 * j, load_at(d_s, t2, 8 * j), load_at(d_s, t2, 8 * j + 1), True)
        pack_a(pf, s, 1)
        mma_words(dv, pf, dot_s, fb)                                    # dV += P^T dO
        pack_a(pf, dp, 1)
        mma_words(dk, pf, qt_s, fb)                                     # dK += dS^T Q
    store_rows(dinp, b, w0, hk, dk, 0, scale, scale, accumulate, lane)
    store_rows(dinp, b, w0, hv, dv, 0, ONE, ONE, accumulate, lane)


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
