"""Flash attention on tensor cores: replaces llmz.kernels.flash_attention's teaching kernels for bf16 values
and head size 64 (GPT-2's), with the same contract: inp (B,T,3C) q | k | v -> out (B,T,C) and lse (B,NH,T)
float32; backward (+)= into dinp (B,T,3C) (or overwrites it); deterministic (every sum in a fixed order, no
atomics); any T (the last tile partial). Results agree with the teaching kernels within bf16 rounding (P and
dS are rounded to bf16 for their products).

FlashAttention-2's layout (Dao 2023), products through llmz.fast.mma (bf16 in, float32 accumulation; the
fragment picture, which lane holds which elements of A, B and C, is drawn at the top of llmz/fast/mma.py):
  A block owns a tile of rows (queries in forward and dq, keys in dk/dv); each warp owns 16 or 32 of them,
  as mma A fragments in registers for the whole kernel (Q; or K and V). The other operand streams past in
  tiles of BC = 64 rows through shared memory (rows padded to PAD = 36 words, so the 8 rows one ldmatrix
  matrix reads start 4 banks apart).
  Moving a tile: cp.async (copy_tile) copies global -> shared 16 bytes a thread without passing through
  registers or making the thread wait; rows past T are zero-filled. Two buffers: tile k+1's copies fly
  while tile k's mmas run, one syncthreads a tile. Fragments come out of the row-major tiles by ldmatrix
  .x4 (four 8x8 matrices an instruction); .trans for an operand read down the streamed axis (V in O += P V,
  K in dq += dS K, Q and dO in dk, dv): no transposed copy is ever staged.
  S = Q K^T: 4 k-steps x 8 n-tiles of m16n8k16 into 32 float32 a lane (its 2 rows x 16 keys) per 16 rows;
  the online softmax runs on those registers (a row's 4 lanes combine with two shuffles); P is packed to
  bf16 A fragments in place (mma.py: the C layout is the A layout) for O += P V. Exponentials are exp2 of
  scores pre-scaled by log2(e)/sqrt(hs) (one FMA and one MUFU each). Causal: a block meets only the tiles up
  to its diagonal, a warp skips the tiles wholly above its own rows, and the mask is applied on the
  diagonal tiles only.

The kernels, each with its own block shape (rows, warps, launch bounds: the module constants below):
  flash_forward_mma_kernel   FWD_ROWS = 128 query rows, FWD_WARPS = 4 warps of 32 rows (two 16-row tiles a
                             warp: every K and V fragment read from shared memory feeds two mmas, and a warp
                             runs two independent mma chains)
  flash_rowsum_kernel        D = rowsum(dout * out), CHUNKS = 8 threads a (b,t,h) row, 16-byte loads
  flash_dkv_mma_kernel       DKV_ROWS = 64 keys, 4 warps of 16: query tiles from the diagonal on,
                             S^T = K Q^T, dP^T = V dO^T, dv += P^T dO, dk += dS^T Q
  flash_dq_mma_kernel        DQ_ROWS = 128 queries, 8 warps of 16: key tiles up to the diagonal,
                             S = Q K^T, dP = dO V^T, dq += dS K
  FA2's recomputation (P from lse, no T x T matrix), with dq in its own pass instead of FA2's dq atomics.
Arrays arrive as uint32 words (two bf16 each): C/2 words a row of out, 3C/2 of inp, head h at words 32h.
dev/flash_attention.py is this file's history: each version, checked and timed, from the first tensor-core
kernels to these (python tools/flash_ptx.py [--dev]: registers, spills, shared memory without a GPU).
"""
import math

import numba
import numpy as np
from numba import config, cuda

from ..device import ceil_div
from ..kernels import flash_attention as teaching
from .device_helpers import pair_view
from .mma import (
    cp_async4,
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    ldmatrix_rows_lane,
    ldmatrix_trans_lane,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    load4_at,
    load_at,
    pack_bf16x2,
    shared_address,
    tile_copy_chunk,
)
from .mma import mma_m16n8k16_bf16 as mma

HS = 64                     # the head size these kernels are written for
WORDS = HS // 2             # uint32 words (bf16 pairs) in one head's row
CHUNKS = WORDS // 4         # 16-byte chunks in one head's row (8: 128 bytes)
BC = 64                     # rows of a streamed tile (keys in forward and dq, queries in dk/dv)
PAD = WORDS + 4             # words a shared row: 144 bytes, 16-byte aligned, rows r and r+1 4 banks apart
TILE_WORDS = BC * PAD       # one shared tile, 1-D
TILE_BYTES = 4 * TILE_WORDS
BUF_WORDS = 4 * TILE_WORDS  # two buffers of two tiles (K and V, or Q and dO)
LSE_FLOATS = 4 * BC         # dk/dv: two buffers of a query tile's lse and D

FWD_WARPS = 4               # forward: warp w owns query rows 32w..32w+31 of the block's
FWD_ROWS = 32 * FWD_WARPS
FWD_THREADS = 32 * FWD_WARPS
FWD_BLOCKS_PER_SM = 2       # the launch bound: <= 255 registers a thread
DQ_WARPS = 8                # dq: warp w owns query rows 16w..16w+15
DQ_ROWS = 16 * DQ_WARPS
DQ_THREADS = 32 * DQ_WARPS
DQ_BLOCKS_PER_SM = 1
DKV_WARPS = 4               # dk/dv: warp w owns keys 16w..16w+15
DKV_ROWS = 16 * DKV_WARPS
DKV_THREADS = 32 * DKV_WARPS
DKV_BLOCKS_PER_SM = 2
ROWSUM_THREADS = 256

LOG2E = np.float32(1.4426950408889634)    # float32 constants keep the arithmetic in float32
NEG = np.float32(-1e30)     # the mask's "minus infinity", finite so fastmath may assume no infinities
ONE = np.float32(1.0)
FULL = 0xFFFFFFFF
ZERO = np.uint32(0)
LO16 = np.uint32(0xFFFF)
HI16 = np.uint32(0xFFFF0000)
S16 = np.uint32(16)


def fast_applies(inp, hs: int) -> bool:
    """These kernels serve bf16 (uint16) values with head size 64; other cases take the teaching kernels."""
    return inp.dtype == np.uint16 and hs == HS


def launch_bounds(threads: int, blocks_per_sm: int) -> dict:
    """cuda.jit's launch_bounds (at most `threads` a block, `blocks_per_sm` resident: ptxas keeps registers
    within 65536 / (threads * blocks_per_sm)); none in the simulator, whose jit takes no bounds."""
    return {} if config.ENABLE_CUDASIM else {"launch_bounds": (threads, blocks_per_sm)}


# ---- device helpers: tiles into shared memory, bf16 pairs -----------------------------------------------
rows_lane = cuda.jit(device=True, inline=True)(ldmatrix_rows_lane)
trans_lane = cuda.jit(device=True, inline=True)(ldmatrix_trans_lane)
copy_chunk = cuda.jit(device=True, inline=True)(tile_copy_chunk)


@cuda.jit(device=True, inline=True)
def copy_tile(dst, x, b, r0, w0, T, W, tid, nthreads):
    # shared tile at byte address dst (BC rows of PAD words) <- words w0..w0+WORDS of rows r0..r0+BC of x[b]
    # (x (B,T,W) words), rows past T zero-filled: cp.async, BC * CHUNKS // nthreads 16-byte copies a thread
    # (which thread copies what: mma.tile_copy_chunk). Waited for at cp_async_wait.
    for i in range(BC * CHUNKS // nthreads):
        r, c = copy_chunk(tid, i, nthreads)
        row = r0 + r
        ok = row < T
        src = (b * T + (row if ok else 0)) * W + w0 + 4 * c
        cp_async16(dst + 4 * (r * PAD + 4 * c), x, src, 16 if ok else 0)


@cuda.jit(device=True, inline=True)
def bf16_lo(w):
    return np.uint32((w & LO16) << S16).view(np.float32)


@cuda.jit(device=True, inline=True)
def bf16_hi(w):
    return np.uint32(w & HI16).view(np.float32)


@cuda.jit(device=True, inline=True)
def store_pair(x, b, r, w, v0, v1, accumulate):
    # word x[b, r, w] = bf16 pair (v0, v1), or (+)= when accumulate (the sum in float32, rounded once)
    if accumulate:
        old = x[b, r, w]
        v0 += bf16_lo(old)
        v1 += bf16_hi(old)
    x[b, r, w] = pack_bf16x2(v0, v1)


# ---- forward ---------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def softmax_tile(s, o, pf, m, lsum, i, k0, w0, g, t, scale_log2):
    # Row tile i of the warp (the lane's rows w0 + 16i + g and +8; its scores s[32i..32i+31]): the causal mask,
    # the online softmax's running max m and sum lsum ([2i], [2i+1]), O's rescale (o[32i..]), and
    # P = exp(scale * (S - max)) packed to bf16 A fragments pf[16i..] (two C tiles of 8 keys = one A
    # fragment of 16).
    ra = w0 + 16 * i + g
    rb = ra + 8
    if k0 + BC - 1 > w0 + 16 * i:               # the tile reaches past the row tile's first row: the mask
        for j in range(8):                      # (keys past T are past every row < T too)
            u = k0 + 8 * j + 2 * t
            x = 32 * i + 4 * j
            if u > ra:
                s[x] = NEG
            if u + 1 > ra:
                s[x + 1] = NEG
            if u > rb:
                s[x + 2] = NEG
            if u + 1 > rb:
                s[x + 3] = NEG
    # the new running max of each row: the lane's 16 scores, then the row's 4 lanes
    xa, xb = m[2 * i], m[2 * i + 1]
    for j in range(8):
        x = 32 * i + 4 * j
        xa = max(xa, max(s[x], s[x + 1]))
        xb = max(xb, max(s[x + 2], s[x + 3]))
    xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 1))
    xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 2))
    xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 1))
    xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 2))
    # rescale the sums and O to the new max
    alpha_a = math.exp2((m[2 * i] - xa) * scale_log2)
    alpha_b = math.exp2((m[2 * i + 1] - xb) * scale_log2)
    m[2 * i], m[2 * i + 1] = xa, xb
    la = lsum[2 * i] * alpha_a
    lb = lsum[2 * i + 1] * alpha_b
    for j in range(8):
        x = 32 * i + 4 * j
        o[x] *= alpha_a
        o[x + 1] *= alpha_a
        o[x + 2] *= alpha_b
        o[x + 3] *= alpha_b
    # P and the lane's part of the row sums
    sa, sb = xa * scale_log2, xb * scale_log2
    for j in range(8):
        x = 32 * i + 4 * j
        s[x] = math.exp2(s[x] * scale_log2 - sa)
        s[x + 1] = math.exp2(s[x + 1] * scale_log2 - sa)
        s[x + 2] = math.exp2(s[x + 2] * scale_log2 - sb)
        s[x + 3] = math.exp2(s[x + 3] * scale_log2 - sb)
        la += s[x] + s[x + 1]
        lb += s[x + 2] + s[x + 3]
    lsum[2 * i], lsum[2 * i + 1] = la, lb
    for kk in range(4):
        x = 32 * i + 8 * kk
        pf[16 * i + 4 * kk] = pack_bf16x2(s[x], s[x + 1])
        pf[16 * i + 4 * kk + 1] = pack_bf16x2(s[x + 2], s[x + 3])
        pf[16 * i + 4 * kk + 2] = pack_bf16x2(s[x + 4], s[x + 5])
        pf[16 * i + 4 * kk + 3] = pack_bf16x2(s[x + 6], s[x + 7])


@cuda.jit(fastmath=True, **launch_bounds(FWD_THREADS, FWD_BLOCKS_PER_SM))
def flash_forward_mma_kernel(out, lse, inp, scale_log2):
    # out (B,T,C/2), inp (B,T,3C/2) words; lse (B,NH,T) float32. Block (query tile of FWD_ROWS, h, b), the
    # longest rows (last query tile) first; warp w: rows 32w.. of the tile, as row tiles 0 (16 rows) and 1
    # (the next 16). Register arrays hold row tile i at [32i..] (o, s), [16i..] (qf, pf), and the statistics
    # of its rows (g, g+8) at [2i], [2i+1] (m, lsum). Overwrites out and lse.
    T, W, C2 = inp.shape[1], inp.shape[2], out.shape[2]
    qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    w0 = qt * FWD_ROWS + 32 * warp              # the warp's first row
    hq = h * WORDS
    smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer s: K tile 2s, V tile 2s+1
    base = shared_address(smem, 0)
    ka = base + 4 * rows_lane(lane, PAD)        # the lane's ldmatrix row addresses in buffer 0
    va = base + TILE_BYTES + 4 * trans_lane(lane, PAD)
    nkt = (min(qt * FWD_ROWS + FWD_ROWS, T) - 1) // BC + 1     # key tiles up to the block's last row
    copy_tile(base, inp, b, 0, C2 + hq, T, W, tid, FWD_THREADS)
    copy_tile(base + TILE_BYTES, inp, b, 0, 2 * C2 + hq, T, W, tid, FWD_THREADS)
    cp_async_commit()
    # Q as A fragments (2 row tiles x 4 k-steps of 16 channels), for the whole kernel
    qf = cuda.local.array(32, numba.uint32)
    for i in range(2):
        ra = w0 + 16 * i + g
        rb = ra + 8
        for kk in range(4):
            qf[16 * i + 4 * kk] = inp[b, ra, hq + 8 * kk + t] if ra < T else ZERO
            qf[16 * i + 4 * kk + 1] = inp[b, rb, hq + 8 * kk + t] if rb < T else ZERO
            qf[16 * i + 4 * kk + 2] = inp[b, ra, hq + 8 * kk + 4 + t] if ra < T else ZERO
            qf[16 * i + 4 * kk + 3] = inp[b, rb, hq + 8 * kk + 4 + t] if rb < T else ZERO
    o = cuda.local.array(64, numba.float32)     # O: rows (ra, rb) x channels 8j+2t, 8j+2t+1, per row tile
    s = cuda.local.array(64, numba.float32)     # S, then P: rows (ra, rb) x keys 8j+2t, 8j+2t+1
    pf = cuda.local.array(32, numba.uint32)     # P as bf16 A fragments
    m = cuda.local.array(4, numba.float32)      # running max (raw scores) and sum of the lane's 4 rows
    lsum = cuda.local.array(4, numba.float32)
    for i in range(64):
        o[i] = 0.0
    for i in range(4):
        m[i] = NEG
        lsum[i] = 0.0
    for kt in range(nkt):
        cp_async_wait(0)
        cuda.syncthreads()                      # tile kt is in; every warp is done with tile kt-1
        if kt + 1 < nkt:                        # whose buffer takes tile kt+1 while tile kt is used
            nxt = base + ((kt + 1) % 2) * 2 * TILE_BYTES
            copy_tile(nxt, inp, b, (kt + 1) * BC, C2 + hq, T, W, tid, FWD_THREADS)
            copy_tile(nxt + TILE_BYTES, inp, b, (kt + 1) * BC, 2 * C2 + hq, T, W, tid, FWD_THREADS)
            cp_async_commit()
        k0 = kt * BC
        if k0 <= w0 + 31:                       # some key of the tile is at or before the warp's last row
            off = (kt % 2) * 2 * TILE_BYTES
            # S = Q K^T: ldmatrix gives n-tile j's B fragments for two k-steps, each used by both row tiles
            for i in range(64):
                s[i] = 0.0
            for kp in range(2):
                for j in range(8):
                    b0, b1, b2, b3 = ldmatrix_x4(ka + off + 4 * (8 * j * PAD + 16 * kp))
                    for i in range(2):
                        x = 32 * i + 4 * j
                        y = 16 * i + 8 * kp
                        s[x], s[x + 1], s[x + 2], s[x + 3] = mma(
                            qf[y], qf[y + 1], qf[y + 2], qf[y + 3], b0, b1, s[x], s[x + 1], s[x + 2], s[x + 3])
                        s[x], s[x + 1], s[x + 2], s[x + 3] = mma(
                            qf[y + 4], qf[y + 5], qf[y + 6], qf[y + 7], b2, b3,
                            s[x], s[x + 1], s[x + 2], s[x + 3])
            softmax_tile(s, o, pf, m, lsum, 0, k0, w0, g, t, scale_log2)     # row tile 0, then 1:
            softmax_tile(s, o, pf, m, lsum, 1, k0, w0, g, t, scale_log2)     # constant offsets
            # O += P V: ldmatrix .trans gives k-step kk's B fragments for n-tiles 2jp, 2jp+1
            for kk in range(4):
                for jp in range(4):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(va + off + 4 * (16 * kk * PAD + 8 * jp))
                    for i in range(2):
                        x = 32 * i + 8 * jp
                        y = 16 * i + 4 * kk
                        o[x], o[x + 1], o[x + 2], o[x + 3] = mma(
                            pf[y], pf[y + 1], pf[y + 2], pf[y + 3], b0, b1, o[x], o[x + 1], o[x + 2], o[x + 3])
                        o[x + 4], o[x + 5], o[x + 6], o[x + 7] = mma(
                            pf[y], pf[y + 1], pf[y + 2], pf[y + 3], b2, b3,
                            o[x + 4], o[x + 5], o[x + 6], o[x + 7])
    # the row sums over the row's 4 lanes; out = O / l; lse = scale * max + log(l)
    for i in range(2):
        ra = w0 + 16 * i + g
        rb = ra + 8
        la, lb = lsum[2 * i], lsum[2 * i + 1]
        la += cuda.shfl_xor_sync(FULL, la, 1)
        la += cuda.shfl_xor_sync(FULL, la, 2)
        lb += cuda.shfl_xor_sync(FULL, lb, 1)
        lb += cuda.shfl_xor_sync(FULL, lb, 2)
        ia, ib = ONE / la, ONE / lb
        for j in range(8):
            x = 32 * i + 4 * j
            if ra < T:
                out[b, ra, hq + 4 * j + t] = pack_bf16x2(o[x] * ia, o[x + 1] * ia)
            if rb < T:
                out[b, rb, hq + 4 * j + t] = pack_bf16x2(o[x + 2] * ib, o[x + 3] * ib)
        if t == 0 and ra < T:
            lse[b, h, ra] = (m[2 * i] * scale_log2 + math.log2(la)) / LOG2E
        if t == 0 and rb < T:
            lse[b, h, rb] = (m[2 * i + 1] * scale_log2 + math.log2(lb)) / LOG2E


# ---- backward --------------------------------------------------------------------------------------
@cuda.jit
def flash_rowsum_kernel(dsum, dout, out):
    # dsum (B,NH,T) float32; dout, out (B,T,C/2) words. dsum[b,h,t] = dout[b,t,h] . out[b,t,h]: CHUNKS = 8
    # threads a (b,t,h) row, each one 16-byte load of each (the row's 128 bytes in one coalesced read), then a
    # three-shuffle sum over the 8 (fixed order). Overwrites dsum.
    B, NH, T = dsum.shape
    idx = cuda.grid(1)
    row = idx // CHUNKS                         # (b*T + t)*NH + h: the head's words start at WORDS*row
    acc = numba.float32(0.0)
    if row < B * T * NH:
        x0, x1, x2, x3 = load4_at(dout, 4 * idx)
        y0, y1, y2, y3 = load4_at(out, 4 * idx)
        acc = (bf16_lo(x0) * bf16_lo(y0) + bf16_hi(x0) * bf16_hi(y0)
               + bf16_lo(x1) * bf16_lo(y1) + bf16_hi(x1) * bf16_hi(y1)
               + bf16_lo(x2) * bf16_lo(y2) + bf16_hi(x2) * bf16_hi(y2)
               + bf16_lo(x3) * bf16_lo(y3) + bf16_hi(x3) * bf16_hi(y3))
    acc += cuda.shfl_xor_sync(FULL, acc, 1)
    acc += cuda.shfl_xor_sync(FULL, acc, 2)
    acc += cuda.shfl_xor_sync(FULL, acc, 4)
    if row < B * T * NH and idx % CHUNKS == 0:
        dsum[row // (NH * T), row % NH, row // NH % T] = acc


@cuda.jit(fastmath=True, **launch_bounds(DQ_THREADS, DQ_BLOCKS_PER_SM))
def flash_dq_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # dinp, inp (B,T,3C/2), dout (B,T,C/2) words; lse, dsum (B,NH,T) float32. Block (query tile of DQ_ROWS,
    # h, b), the longest first; warp w: rows 16w..16w+15 of the tile. dq_t = scale * sum over keys u <= t of
    # dS[t,u] k_u, key tiles in order up to the diagonal. (+)= into dinp's q part (accumulate=False:
    # overwrites).
    T, W, C2 = inp.shape[1], inp.shape[2], dout.shape[2]
    qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    w0 = qt * DQ_ROWS + 16 * warp               # the warp's first row
    ra = w0 + g                                 # the lane's two rows
    rb = ra + 8
    hq = h * WORDS
    smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer s: K tile 2s, V tile 2s+1
    base = shared_address(smem, 0)
    ka = base + 4 * rows_lane(lane, PAD)        # K's rows (S = Q K^T), K down the keys (dq += dS K), V's rows
    kta = base + 4 * trans_lane(lane, PAD)
    va = base + TILE_BYTES + 4 * rows_lane(lane, PAD)
    nkt = (min(qt * DQ_ROWS + DQ_ROWS, T) - 1) // BC + 1
    copy_tile(base, inp, b, 0, C2 + hq, T, W, tid, DQ_THREADS)
    copy_tile(base + TILE_BYTES, inp, b, 0, 2 * C2 + hq, T, W, tid, DQ_THREADS)
    cp_async_commit()
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
    s = cuda.local.array(32, numba.float32)     # S, then dS
    dp = cuda.local.array(32, numba.float32)
    pf = cuda.local.array(16, numba.uint32)
    for i in range(32):
        dq[i] = 0.0
    for kt in range(nkt):
        cp_async_wait(0)
        cuda.syncthreads()
        if kt + 1 < nkt:
            nxt = base + ((kt + 1) % 2) * 2 * TILE_BYTES
            copy_tile(nxt, inp, b, (kt + 1) * BC, C2 + hq, T, W, tid, DQ_THREADS)
            copy_tile(nxt + TILE_BYTES, inp, b, (kt + 1) * BC, 2 * C2 + hq, T, W, tid, DQ_THREADS)
            cp_async_commit()
        k0 = kt * BC
        if k0 <= w0 + 15:                       # some key of the tile is at or before the warp's last row
            off = (kt % 2) * 2 * TILE_BYTES
            # S = Q K^T and dP = dO V^T
            for i in range(32):
                s[i] = 0.0
                dp[i] = 0.0
            for kp in range(2):
                for j in range(8):
                    b0, b1, b2, b3 = ldmatrix_x4(ka + off + 4 * (8 * j * PAD + 16 * kp))
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                        qf[8 * kp], qf[8 * kp + 1], qf[8 * kp + 2], qf[8 * kp + 3], b0, b1,
                        s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                        qf[8 * kp + 4], qf[8 * kp + 5], qf[8 * kp + 6], qf[8 * kp + 7], b2, b3,
                        s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                    b0, b1, b2, b3 = ldmatrix_x4(va + off + 4 * (8 * j * PAD + 16 * kp))
                    dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3] = mma(
                        dof[8 * kp], dof[8 * kp + 1], dof[8 * kp + 2], dof[8 * kp + 3], b0, b1,
                        dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3])
                    dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3] = mma(
                        dof[8 * kp + 4], dof[8 * kp + 5], dof[8 * kp + 6], dof[8 * kp + 7], b2, b3,
                        dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3])
            # P = exp(scale S - lse), 0 above the diagonal; dS = P (dP - D)
            masked = k0 + BC - 1 > w0
            for j in range(8):
                u = k0 + 8 * j + 2 * t
                p0 = math.exp2(s[4 * j] * scale_log2 - la)
                p1 = math.exp2(s[4 * j + 1] * scale_log2 - la)
                p2 = math.exp2(s[4 * j + 2] * scale_log2 - lb)
                p3 = math.exp2(s[4 * j + 3] * scale_log2 - lb)
                if masked:
                    p0 = p0 if u <= ra else numba.float32(0.0)
                    p1 = p1 if u + 1 <= ra else numba.float32(0.0)
                    p2 = p2 if u <= rb else numba.float32(0.0)
                    p3 = p3 if u + 1 <= rb else numba.float32(0.0)
                s[4 * j] = p0 * (dp[4 * j] - da)
                s[4 * j + 1] = p1 * (dp[4 * j + 1] - da)
                s[4 * j + 2] = p2 * (dp[4 * j + 2] - db)
                s[4 * j + 3] = p3 * (dp[4 * j + 3] - db)
            for kk in range(4):
                pf[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
                pf[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
                pf[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
                pf[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
            # dq += dS K: K read down the key axis (ldmatrix .trans)
            for kk in range(4):
                for jp in range(4):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(kta + off + 4 * (16 * kk * PAD + 8 * jp))
                    dq[8 * jp], dq[8 * jp + 1], dq[8 * jp + 2], dq[8 * jp + 3] = mma(
                        pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b0, b1,
                        dq[8 * jp], dq[8 * jp + 1], dq[8 * jp + 2], dq[8 * jp + 3])
                    dq[8 * jp + 4], dq[8 * jp + 5], dq[8 * jp + 6], dq[8 * jp + 7] = mma(
                        pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b2, b3,
                        dq[8 * jp + 4], dq[8 * jp + 5], dq[8 * jp + 6], dq[8 * jp + 7])
    for j in range(8):
        if ra < T:
            store_pair(dinp, b, ra, hq + 4 * j + t, dq[4 * j] * scale, dq[4 * j + 1] * scale, accumulate)
        if rb < T:
            store_pair(dinp, b, rb, hq + 4 * j + t, dq[4 * j + 2] * scale, dq[4 * j + 3] * scale, accumulate)


@cuda.jit(fastmath=True, **launch_bounds(DKV_THREADS, DKV_BLOCKS_PER_SM))
def flash_dkv_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # As flash_dq_mma_kernel for dk and dv: block (key tile of DKV_ROWS, h, b), the longest (first key tile)
    # first; warp w: keys 16w..16w+15, the lane's keys ka, kb; query tiles of BC in order from the diagonal
    # to the last:
    #   S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D)
    #   dv += P^T dO, dk += scale dS^T Q.   (+)= into dinp's k and v parts (accumulate=False: overwrites).
    T, W, C2 = inp.shape[1], inp.shape[2], dout.shape[2]
    NH = lse.shape[1]
    kt = cuda.blockIdx.x
    h, b = cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    w0 = kt * DKV_ROWS + 16 * warp              # the warp's first key
    ka = w0 + g
    kb = ka + 8
    hq = h * WORDS
    hk, hv = C2 + hq, 2 * C2 + hq
    smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer s: Q tile 2s, dO tile 2s+1
    sld = cuda.shared.array(LSE_FLOATS, numba.float32)    # buffer s: lse at 2s*BC, D at (2s+1)*BC
    base = shared_address(smem, 0)
    lbase = shared_address(sld, 0)
    qa = base + 4 * rows_lane(lane, PAD)        # Q's and dO's rows, and down their queries (.trans)
    qta = base + 4 * trans_lane(lane, PAD)
    da_ = base + TILE_BYTES + 4 * rows_lane(lane, PAD)
    dta = base + TILE_BYTES + 4 * trans_lane(lane, PAD)
    lrow = (b * NH + h) * T                     # flat index of lse[b, h, 0] and dsum[b, h, 0]
    first = (kt * DKV_ROWS) // BC               # the query tile of the block's first key (the diagonal)
    nqt = (T - 1) // BC + 1

    qf0 = first * BC                            # copy query tile `first` into buffer 0
    copy_tile(base, inp, b, qf0, hq, T, W, tid, DKV_THREADS)
    copy_tile(base + TILE_BYTES, dout, b, qf0, hq, T, C2, tid, DKV_THREADS)
    if tid < 2 * BC:
        i = tid % BC
        ok = qf0 + i < T
        src = lrow + (qf0 + i if ok else 0)
        if tid < BC:
            cp_async4(lbase + 4 * i, lse, src, 4 if ok else 0)
        else:
            cp_async4(lbase + 4 * (BC + i), dsum, src, 4 if ok else 0)
    cp_async_commit()
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
    for qt in range(first, nqt):
        cp_async_wait(0)
        cuda.syncthreads()
        if qt + 1 < nqt:
            q1 = (qt + 1) * BC
            st = (qt + 1 - first) % 2
            nxt = base + st * 2 * TILE_BYTES
            copy_tile(nxt, inp, b, q1, hq, T, W, tid, DKV_THREADS)
            copy_tile(nxt + TILE_BYTES, dout, b, q1, hq, T, C2, tid, DKV_THREADS)
            if tid < 2 * BC:
                i = tid % BC
                ok = q1 + i < T
                src = lrow + (q1 + i if ok else 0)
                if tid < BC:
                    cp_async4(lbase + 4 * (2 * st * BC + i), lse, src, 4 if ok else 0)
                else:
                    cp_async4(lbase + 4 * ((2 * st + 1) * BC + i), dsum, src, 4 if ok else 0)
            cp_async_commit()
        q0 = qt * BC
        if q0 + BC - 1 >= w0:                   # some query of the tile is at or after the warp's first key
            st = (qt - first) % 2
            off = st * 2 * TILE_BYTES
            lo = 2 * st * BC                    # lse of the buffer at sld[lo..], D at sld[lo + BC..]
            for i in range(32):
                s[i] = 0.0
                dp[i] = 0.0
            # S^T = K Q^T and dP^T = V dO^T: B fragments from Q's and dO's rows
            for kp in range(2):
                for j in range(8):
                    b0, b1, b2, b3 = ldmatrix_x4(qa + off + 4 * (8 * j * PAD + 16 * kp))
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                        kf[8 * kp], kf[8 * kp + 1], kf[8 * kp + 2], kf[8 * kp + 3], b0, b1,
                        s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                    s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                        kf[8 * kp + 4], kf[8 * kp + 5], kf[8 * kp + 6], kf[8 * kp + 7], b2, b3,
                        s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                    b0, b1, b2, b3 = ldmatrix_x4(da_ + off + 4 * (8 * j * PAD + 16 * kp))
                    dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3] = mma(
                        vf[8 * kp], vf[8 * kp + 1], vf[8 * kp + 2], vf[8 * kp + 3], b0, b1,
                        dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3])
                    dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3] = mma(
                        vf[8 * kp + 4], vf[8 * kp + 5], vf[8 * kp + 6], vf[8 * kp + 7], b2, b3,
                        dp[4 * j], dp[4 * j + 1], dp[4 * j + 2], dp[4 * j + 3])
            # P^T = exp(scale S^T - lse[query]), 0 where query < key or query >= T; dS^T = P^T (dP^T - D)
            masked = q0 < w0 + 15 or q0 + BC > T
            for j in range(8):
                c = 8 * j + 2 * t               # the lane's two queries: q0 + c, q0 + c + 1
                l0 = load_at(sld, lo + 2 * t, 8 * j) * LOG2E
                l1 = load_at(sld, lo + 2 * t, 8 * j + 1) * LOG2E
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
                d0 = load_at(sld, lo + BC + 2 * t, 8 * j)
                d1 = load_at(sld, lo + BC + 2 * t, 8 * j + 1)
                dp[4 * j] = p0 * (dp[4 * j] - d0)
                dp[4 * j + 1] = p1 * (dp[4 * j + 1] - d1)
                dp[4 * j + 2] = p2 * (dp[4 * j + 2] - d0)
                dp[4 * j + 3] = p3 * (dp[4 * j + 3] - d1)
            # dv += P^T dO (dO read down the query axis: .trans)
            for kk in range(4):
                pf[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
                pf[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
                pf[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
                pf[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
            for kk in range(4):
                for jp in range(4):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(dta + off + 4 * (16 * kk * PAD + 8 * jp))
                    dv[8 * jp], dv[8 * jp + 1], dv[8 * jp + 2], dv[8 * jp + 3] = mma(
                        pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b0, b1,
                        dv[8 * jp], dv[8 * jp + 1], dv[8 * jp + 2], dv[8 * jp + 3])
                    dv[8 * jp + 4], dv[8 * jp + 5], dv[8 * jp + 6], dv[8 * jp + 7] = mma(
                        pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b2, b3,
                        dv[8 * jp + 4], dv[8 * jp + 5], dv[8 * jp + 6], dv[8 * jp + 7])
            # dk += dS^T Q (Q read down the query axis: .trans)
            for kk in range(4):
                pf[4 * kk] = pack_bf16x2(dp[8 * kk], dp[8 * kk + 1])
                pf[4 * kk + 1] = pack_bf16x2(dp[8 * kk + 2], dp[8 * kk + 3])
                pf[4 * kk + 2] = pack_bf16x2(dp[8 * kk + 4], dp[8 * kk + 5])
                pf[4 * kk + 3] = pack_bf16x2(dp[8 * kk + 6], dp[8 * kk + 7])
            for kk in range(4):
                for jp in range(4):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(qta + off + 4 * (16 * kk * PAD + 8 * jp))
                    dk[8 * jp], dk[8 * jp + 1], dk[8 * jp + 2], dk[8 * jp + 3] = mma(
                        pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b0, b1,
                        dk[8 * jp], dk[8 * jp + 1], dk[8 * jp + 2], dk[8 * jp + 3])
                    dk[8 * jp + 4], dk[8 * jp + 5], dk[8 * jp + 6], dk[8 * jp + 7] = mma(
                        pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b2, b3,
                        dk[8 * jp + 4], dk[8 * jp + 5], dk[8 * jp + 6], dk[8 * jp + 7])
    for j in range(8):
        if ka < T:
            store_pair(dinp, b, ka, hk + 4 * j + t, dk[4 * j] * scale, dk[4 * j + 1] * scale, accumulate)
            store_pair(dinp, b, ka, hv + 4 * j + t, dv[4 * j], dv[4 * j + 1], accumulate)
        if kb < T:
            store_pair(dinp, b, kb, hk + 4 * j + t, dk[4 * j + 2] * scale, dk[4 * j + 3] * scale, accumulate)
            store_pair(dinp, b, kb, hv + 4 * j + t, dv[4 * j + 2], dv[4 * j + 3], accumulate)


# ---- the layer: the tensor-core kernels where they apply, the teaching kernels elsewhere ------------------
def flash_attention_forward(dev, out, lse, inp, num_heads) -> None:
    """As llmz.kernels.flash_attention.flash_attention_forward (the same arguments and contract): bf16 values of
    head size 64 on tensor cores; fp32, fp64 and other head sizes on the teaching kernels (exact, slow: fp32
    training keeps --attention gemm, cuBLAS TF32, as its default)."""
    if not fast_applies(inp, inp.shape[2] // 3 // num_heads):
        return teaching.flash_attention_forward(dev, out, lse, inp, num_heads)
    flash_attention_forward_fast(dev, out, lse, inp, num_heads)


def flash_attention_backward(dev, dinp, dout, inp, out, lse, num_heads, accumulate=True) -> None:
    """As llmz.kernels.flash_attention.flash_attention_backward, on tensor cores where forward's are."""
    if not fast_applies(inp, inp.shape[2] // 3 // num_heads):
        return teaching.flash_attention_backward(dev, dinp, dout, inp, out, lse, num_heads, accumulate)
    dsum = dev.scratch("flash_attention_dsum", lse.shape, lse.dtype)
    flash_attention_backward_fast(dev, dinp, dout, inp, out, lse, dsum, num_heads, accumulate)


# ---- the kernels' launches ------------------------------------------------------------------------------
SCALE = np.float32(1.0 / math.sqrt(HS))


def causal_flops(B, NH, T, products):
    """Useful flops of `products` causal (T x T / 2) x hs products."""
    return products * B * NH * HS * T * (T + 1)


def flash_attention_forward_fast(dev, out, lse, inp, num_heads) -> None:
    """As llmz.kernels.flash_attention.flash_attention_forward, on tensor cores (fast_applies must hold)."""
    B, T, _ = inp.shape
    dev.launch(flash_forward_mma_kernel, (ceil_div(T, FWD_ROWS), num_heads, B), FWD_THREADS,
               pair_view(out), lse, pair_view(inp), SCALE * LOG2E, flops=causal_flops(B, num_heads, T, 2))


def flash_attention_backward_fast(dev, dinp, dout, inp, out, lse, dsum, num_heads, accumulate=True) -> None:
    """As llmz.kernels.flash_attention.flash_attention_backward, on tensor cores; dsum (B,NH,T) float32
    scratch receives D = rowsum(dout * out)."""
    B, T, _ = inp.shape
    dout2, inp2, dinp2 = pair_view(dout), pair_view(inp), pair_view(dinp)
    dev.launch(flash_rowsum_kernel, ceil_div(B * T * num_heads * CHUNKS, ROWSUM_THREADS), ROWSUM_THREADS,
               dsum, dout2, pair_view(out))
    dev.launch(flash_dkv_mma_kernel, (ceil_div(T, DKV_ROWS), num_heads, B), DKV_THREADS, dinp2, dout2, inp2,
               lse, dsum, SCALE * LOG2E, SCALE, accumulate, flops=causal_flops(B, num_heads, T, 4))
    dev.launch(flash_dq_mma_kernel, (ceil_div(T, DQ_ROWS), num_heads, B), DQ_THREADS, dinp2, dout2, inp2,
               lse, dsum, SCALE * LOG2E, SCALE, accumulate, flops=causal_flops(B, num_heads, T, 3))
