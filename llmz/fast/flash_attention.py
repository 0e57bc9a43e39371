"""Flash attention on tensor cores: replaces llmz.kernels.flash_attention's teaching kernels for bf16 values
of head size HS = 64 (GPT-2's at every size; fast_flash_covers, fallback_note), with the same contract: inp
(B,T,3C) q | k | v -> out (B,T,C) and lse (B,NH,T) float32; backward (+)= into dinp (B,T,3C) (or overwrites
it); deterministic (every sum in a fixed order, no atomics); any T (the last tile partial). Results agree
with the teaching kernels within bf16 rounding (P and dS are rounded to bf16 for their products).

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
Each kernel reads as the paper's algorithm: its lines are device functions (load_tiles, load_fragments,
mma_a_bt for S = Q K^T, online_softmax, pack_a, mma_a_b for O += P V, recompute_p, causal_mask, compute_ds,
store_rows), inlined, so a kernel compiles to the same instructions as one written out in full.
Arrays arrive as uint32 words (two bf16 each): C/2 words a row of out, 3C/2 of inp, head h at words 32h.
dev/flash_attention.py is this file's history: each version, checked and timed, from the first tensor-core
kernels to these (python tools/flash_ptx.py [--dev]: registers, spills, shared memory without a GPU).
"""
import math
import re
import types
from pathlib import Path

import numba
import numpy as np
from numba import config, cuda

from ..kernels import flash_attention as teaching
from ..kernels.grid import ceil_div
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

HS = 64                     # the head size these kernels are compiled for (a multiple of 32)
WORDS = HS // 2             # uint32 words (bf16 pairs) in one head's row
CHUNKS = WORDS // 4         # 16-byte chunks in one head's row (8: 128 bytes)
BC = 64                     # rows of a streamed tile (keys in forward and dq, queries in dk/dv; 32 or 64)
PAD = WORDS + 4             # words a shared row: 144 bytes, 16-byte aligned, rows r and r+1 4 banks apart
A_HS = HS // 4              # a lane's words of a 16-row tile's A fragments over HS channels (HS/16 k-steps)
C_HS = HS // 2              # a lane's floats of its C fragments over HS channels (HS/8 n-tiles)
A_BC = BC // 4              # ... over a streamed tile's BC rows (P and dS as A fragments)
C_BC = BC // 2              # ... (S, P, dP, dS)
TILE_WORDS = BC * PAD       # one shared tile, 1-D
TILE_BYTES = 4 * TILE_WORDS
BUF_WORDS = 4 * TILE_WORDS  # two buffers of two tiles (K and V, or Q and dO)
BUF_BYTES = 2 * TILE_BYTES  # one buffer
LSE_FLOATS = 4 * BC         # dk/dv: two buffers of a query tile's lse and D

FWD_WARPS = 4               # forward: warp w owns query rows 32w..32w+31 of the block's,
FWD_TILES = 2               # as two row tiles of 16
FWD_ROWS = 16 * FWD_TILES * FWD_WARPS
FWD_THREADS = 32 * FWD_WARPS
FWD_BLOCKS_PER_SM = 2       # the launch bound: <= 255 registers a thread
FWD_A, FWD_O = FWD_TILES * A_HS, FWD_TILES * C_HS      # the forward's register arrays: Q's fragments, O,
FWD_S, FWD_P = FWD_TILES * C_BC, FWD_TILES * A_BC      # S (then P~), P~'s fragments,
FWD_M = 2 * FWD_TILES                                  # m and l of the lane's rows
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
ZERO_F = np.float32(0.0)
FULL = 0xFFFFFFFF
ZERO = np.uint32(0)
LO16 = np.uint32(0xFFFF)
HI16 = np.uint32(0xFFFF0000)
S16 = np.uint32(16)


def fast_flash_covers(head_size: int) -> bool:
    """Whether these kernels serve bf16 attention of this head size (they are compiled for HS = 64, every
    GPT-2 size from d12 to d48); bf16 at another head size takes the teaching kernels."""
    return head_size == HS


def fast_applies(inp, hs: int) -> bool:
    """These kernels serve bf16 (uint16) values of the head size they cover; other cases take the teaching
    kernels."""
    return inp.dtype == np.uint16 and fast_flash_covers(hs)


def fallback_note(head_size: int) -> str | None:
    """One line for the start of a bf16 run with --attention flash whose head size these kernels do not
    cover (None when they do): what runs instead, and the faster choice."""
    if fast_flash_covers(head_size):
        return None
    if head_size > teaching.HS_MAX:
        return (f"bf16 --attention flash: head size {head_size} is beyond the tensor-core kernels (head size {HS}) "
                f"and the teaching kernels (at most {teaching.HS_MAX}); use --attention gemm")
    return (f"note: bf16 --attention flash with head size {head_size} runs on the teaching kernels (the tensor-core "
            f"kernels cover head size {HS} only): hundreds of times slower; --attention gemm runs it on cuBLAS")


def launch_bounds(threads: int, blocks_per_sm: int) -> dict:
    """cuda.jit's launch_bounds (at most `threads` a block, `blocks_per_sm` resident: ptxas keeps registers
    within 65536 / (threads * blocks_per_sm)); none in the simulator, whose jit takes no bounds."""
    return {} if config.ENABLE_CUDASIM else {"launch_bounds": (threads, blocks_per_sm)}


# ---- device functions: FlashAttention-2's steps on a warp's fragments -------------------------------------
# Each is inlined into the kernel that calls it (Numba IR inlining; LLVM then unrolls the loops over fragment
# elements, so the arrays stay in registers). A warp's rows come in row tiles of 16: lane 4g+t holds rows g and
# g+8 (llmz/fast/mma.py's picture). Row tile i's C fragments (16 rows x N columns, float32: N = BC for S, P,
# dP, dS; HS for O, dQ, dK, dV) sit at c[(N/2) i..], n-tile j (8 columns) at c[(N/2) i + 4j..]; its A
# fragments (16 rows x N bf16, N/16 k-steps of 4 words) at a[(N/4) i..]. A streamed tile is BC rows of one
# head's HS channels in shared memory (PAD-word rows).
rows_lane = cuda.jit(device=True, inline=True)(ldmatrix_rows_lane)
trans_lane = cuda.jit(device=True, inline=True)(ldmatrix_trans_lane)
copy_chunk = cuda.jit(device=True, inline=True)(tile_copy_chunk)


@cuda.jit(device=True, inline=True)
def block_rows(rows, warp_rows, last_first):
    # (tid, lane, h, b, r0, w0): this thread; its block's head, batch and first row r0 (block (x, h, b) owns
    # `rows` rows, the last x first when last_first: the longest causal rows start first); its warp's first
    # row w0 (each warp owns `warp_rows` rows)
    x = cuda.gridDim.x - 1 - cuda.blockIdx.x if last_first else cuda.blockIdx.x
    tid = cuda.threadIdx.x
    r0 = x * rows
    return tid, tid % 32, cuda.blockIdx.y, cuda.blockIdx.z, r0, r0 + warp_rows * (tid // 32)


@cuda.jit(device=True, inline=True)
def copy_tile(dst, x, b, r0, w0, tid, nthreads):
    # shared tile at byte address dst <- words w0..w0+WORDS of rows r0..r0+BC of x[b] (x (B,T,W) words), rows
    # past T zero-filled: cp.async, BC * CHUNKS // nthreads 16-byte copies a thread (mma.tile_copy_chunk)
    T, W = x.shape[1], x.shape[2]
    for i in range(BC * CHUNKS // nthreads):
        r, c = copy_chunk(tid, i, nthreads, CHUNKS)
        row = r0 + r
        ok = row < T
        src = (b * T + (row if ok else 0)) * W + w0 + 4 * c
        cp_async16(dst + 4 * (r * PAD + 4 * c), x, src, 16 if ok else 0)


@cuda.jit(device=True, inline=True)
def load_tiles(dst, x, wx, y, wy, b, r0, tid, nthreads):
    # "Load K_j, V_j from HBM to on-chip SRAM" (Q_i, dO_i in dk/dv): rows r0..r0+BC of x's words wx.. into the
    # shared tile at dst, of y's words wy.. into the tile after it; one cp.async group, in after wait_tiles
    copy_tile(dst, x, b, r0, wx, tid, nthreads)
    copy_tile(dst + TILE_BYTES, y, b, r0, wy, tid, nthreads)
    cp_async_commit()


@cuda.jit(device=True, inline=True)
def load_stats(dst, lse, dsum, b, h, q0, tid):
    # L and D of queries q0..q0+BC (0 past T) into BC shared floats at byte address dst and the BC after them:
    # cp.async by threads 0..2BC-1, in the group the next commit closes
    T = lse.shape[2]
    if tid < 2 * BC:
        i = tid % BC
        ok = q0 + i < T
        src = (b * lse.shape[1] + h) * T + (q0 + i if ok else 0)
        if tid < BC:
            cp_async4(dst + 4 * i, lse, src, 4 if ok else 0)
        else:
            cp_async4(dst + 4 * (BC + i), dsum, src, 4 if ok else 0)


@cuda.jit(device=True, inline=True)
def wait_tiles():
    # every thread's copies of the last group are in, and every warp is done with the other buffer
    cp_async_wait(0)
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def rows_address(tile, lane):
    # this lane's ldmatrix address for B fragments read along the rows of the tile at byte address `tile`
    return tile + 4 * rows_lane(lane, PAD)


@cuda.jit(device=True, inline=True)
def trans_address(tile, lane):
    # this lane's ldmatrix .trans address for B fragments read down the rows (the streamed axis) of the tile
    return tile + 4 * trans_lane(lane, PAD)


@cuda.jit(device=True, inline=True)
def load_fragments(a, i, x, b, r0, w0, lane):
    # "Load Q_i" into registers: a[A_HS i..] <- the A fragments of rows r0+g and r0+g+8 of x[b] (words
    # w0..w0+WORDS), 0 past T
    T = x.shape[1]
    g, t = lane // 4, lane % 4
    ra, rb = r0 + g, r0 + g + 8
    for kk in range(HS // 16):
        y = A_HS * i + 4 * kk
        a[y] = x[b, ra, w0 + 8 * kk + t] if ra < T else ZERO
        a[y + 1] = x[b, rb, w0 + 8 * kk + t] if rb < T else ZERO
        a[y + 2] = x[b, ra, w0 + 8 * kk + 4 + t] if ra < T else ZERO
        a[y + 3] = x[b, rb, w0 + 8 * kk + 4 + t] if rb < T else ZERO


@cuda.jit(device=True, inline=True)
def mma_tile(c, x, a, y, b0, b1):
    # c[x..x+3] (a 16 x 8 C fragment) += A B: A the fragment a[y..y+3] (16 x 16), B the registers (b0, b1)
    c[x], c[x + 1], c[x + 2], c[x + 3] = mma(a[y], a[y + 1], a[y + 2], a[y + 3], b0, b1,
                                             c[x], c[x + 1], c[x + 2], c[x + 3])


@cuda.jit(device=True, inline=True)
def mma_a_bt(c, a, b_rows, tiles):
    # C = A B^T for row tiles 0..tiles-1 (S = Q K^T, dP = dO V^T): A's HS channels in a, B^T the streamed
    # tile read along its rows by ldmatrix from b_rows (rows_address); C (16 x BC a row tile) into c. One
    # ldmatrix gives n-tile j's B fragments for two k-steps, used by every row tile.
    for x in range(C_BC * tiles):
        c[x] = 0.0
    for kp in range(HS // 32):
        for j in range(BC // 8):
            b0, b1, b2, b3 = ldmatrix_x4(b_rows + 4 * (8 * j * PAD + 16 * kp))
            for i in range(tiles):
                mma_tile(c, C_BC * i + 4 * j, a, A_HS * i + 8 * kp, b0, b1)
                mma_tile(c, C_BC * i + 4 * j, a, A_HS * i + 8 * kp + 4, b2, b3)


@cuda.jit(device=True, inline=True)
def mma_a_b(c, a, b_trans, tiles):
    # C += A B for row tiles 0..tiles-1 (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q): A (16 x BC a row
    # tile) in a, B the streamed tile read down its rows by ldmatrix .trans from b_trans (trans_address); C
    # (16 x HS channels a row tile) in c. One ldmatrix gives k-step kk's B fragments for two n-tiles.
    for kk in range(BC // 16):
        for jp in range(HS // 16):
            b0, b1, b2, b3 = ldmatrix_x4_trans(b_trans + 4 * (16 * kk * PAD + 8 * jp))
            for i in range(tiles):
                mma_tile(c, C_HS * i + 8 * jp, a, A_BC * i + 4 * kk, b0, b1)
                mma_tile(c, C_HS * i + 8 * jp + 4, a, A_BC * i + 4 * kk, b2, b3)


@cuda.jit(device=True, inline=True)
def pack_a(a, c, tiles):
    # row tiles 0..tiles-1's C fragments (16 x BC float32 each) -> bf16 A fragments a for the next product:
    # n-tiles 2kk and 2kk+1 are k-step kk (llmz/fast/mma.py: the C layout is the A layout)
    for i in range(tiles):
        for kk in range(BC // 16):
            x, y = C_BC * i + 8 * kk, A_BC * i + 4 * kk
            a[y] = pack_bf16x2(c[x], c[x + 1])
            a[y + 1] = pack_bf16x2(c[x + 2], c[x + 3])
            a[y + 2] = pack_bf16x2(c[x + 4], c[x + 5])
            a[y + 3] = pack_bf16x2(c[x + 6], c[x + 7])


@cuda.jit(device=True, inline=True)
def causal_mask(s, i, r0, c0, lane, T, transposed, fill):
    # `fill` in row tile i where the key is after the query: NEG in S before the softmax (forward), 0 in P
    # (backward). S: rows are queries r0+g, r0+g+8, columns keys c0+8j+2t, +1; S^T (transposed): rows keys,
    # columns queries, and the queries past T (zero-filled rows: P = exp(0 - 0)) filled too. (In S, keys
    # past T are past every query < T.)
    g, t = lane // 4, lane % 4
    for j in range(BC // 8):
        for e in range(4):
            r = r0 + g + 8 * (e // 2)
            c = c0 + 8 * j + 2 * t + e % 2
            x = C_BC * i + 4 * j + e
            s[x] = fill if (((c < r) | (c >= T)) if transposed else c > r) else s[x]


@cuda.jit(device=True, inline=True)
def row_max(x):
    # the max over the 4 lanes holding a fragment row
    x = max(x, cuda.shfl_xor_sync(FULL, x, 1))
    return max(x, cuda.shfl_xor_sync(FULL, x, 2))


@cuda.jit(device=True, inline=True)
def row_sum(x):
    # the sum over the 4 lanes holding a fragment row
    x += cuda.shfl_xor_sync(FULL, x, 1)
    return x + cuda.shfl_xor_sync(FULL, x, 2)


@cuda.jit(device=True, inline=True)
def online_softmax(s, o, m, l, tiles, scale_log2):
    # Algorithm 1's inner step on row tiles 0..tiles-1, row by row (the lane's row r: tile r // 2, row g or g+8
    # as r is even or odd, n-tile elements 2(r % 2), +1; its m[r], l[r]): m_new = max(m, rowmax(S));
    # P~ = exp(S - m_new) (into s); l = exp(m - m_new) l + rowsum(P~); O = diag(exp(m - m_new)) O.
    # S is raw q.k: the scale goes into exp2's argument (scale_log2 = log2(e) / sqrt(hs)).
    for r in range(2 * tiles):
        xs, xo = C_BC * (r // 2) + 2 * (r % 2), C_HS * (r // 2) + 2 * (r % 2)
        mx = m[r]
        for j in range(BC // 8):
            mx = max(mx, max(s[xs + 4 * j], s[xs + 4 * j + 1]))
        mx = row_max(mx)
        alpha = math.exp2((m[r] - mx) * scale_log2)
        m[r] = mx
        lr = l[r] * alpha
        for j in range(HS // 8):
            o[xo + 4 * j] *= alpha
            o[xo + 4 * j + 1] *= alpha
        sm = mx * scale_log2
        for j in range(BC // 8):
            x = xs + 4 * j
            s[x] = math.exp2(s[x] * scale_log2 - sm)
            s[x + 1] = math.exp2(s[x + 1] * scale_log2 - sm)
            lr += s[x] + s[x + 1]
        l[r] = lr


@cuda.jit(device=True, inline=True)
def store_rows(dst, b, r0, w0, c, i, scale_a, scale_b, accumulate, lane):
    # "Write ... to HBM": row tile i's C fragments times scale_a (row r0+g) and scale_b (row r0+g+8), as bf16
    # pairs into words w0..w0+WORDS of those rows of dst[b] (the rows < T); (+)= when accumulate
    T = dst.shape[1]
    g, t = lane // 4, lane % 4
    ra, rb = r0 + g, r0 + g + 8
    for j in range(HS // 8):
        x = C_HS * i + 4 * j
        if ra < T:
            store_pair(dst, b, ra, w0 + 4 * j + t, c[x] * scale_a, c[x + 1] * scale_a, accumulate)
        if rb < T:
            store_pair(dst, b, rb, w0 + 4 * j + t, c[x + 2] * scale_b, c[x + 3] * scale_b, accumulate)


@cuda.jit(device=True, inline=True)
def write_o_lse(out, lse, o, m, l, i, b, h, r0, w0, lane, scale_log2):
    # Algorithm 1's end for row tile i (rows r0+g, r0+g+8): l summed over the row's lanes; O_i = diag(l)^-1 O_i
    # into out's words w0..; L_i = m + log(l) into lse (natural log)
    la, lb = row_sum(l[2 * i]), row_sum(l[2 * i + 1])
    store_rows(out, b, r0, w0, o, i, ONE / la, ONE / lb, False, lane)
    T = out.shape[1]
    ra, rb = r0 + lane // 4, r0 + lane // 4 + 8
    if lane % 4 == 0 and ra < T:
        lse[b, h, ra] = (m[2 * i] * scale_log2 + math.log2(la)) / LOG2E
    if lane % 4 == 0 and rb < T:
        lse[b, h, rb] = (m[2 * i + 1] * scale_log2 + math.log2(lb)) / LOG2E


@cuda.jit(device=True, inline=True)
def row_stats(lse, dsum, b, h, r):
    # (L in log2 units, D) of query row r, as recompute_p and compute_ds take them; 0 past T
    if r < lse.shape[2]:
        return lse[b, h, r] * LOG2E, dsum[b, h, r]
    return numba.float32(0.0), numba.float32(0.0)


@cuda.jit(device=True, inline=True)
def load_query_rows(qf, dof, inp, dout, lse, dsum, b, h, r0, lane):
    # "Load Q_i, dO_i, L_i, D_i" for the query rows r0+g, r0+g+8: Q's and dO's A fragments into qf and dof;
    # returns their (L, D) as row_stats gives them: (la, lb, da, db)
    load_fragments(qf, 0, inp, b, r0, h * WORDS, lane)
    load_fragments(dof, 0, dout, b, r0, h * WORDS, lane)
    la, da = row_stats(lse, dsum, b, h, r0 + lane // 4)
    lb, db = row_stats(lse, dsum, b, h, r0 + lane // 4 + 8)
    return la, lb, da, db


@cuda.jit(device=True, inline=True)
def recompute_p(s, x, l0, l1, transposed, scale_log2):
    # Algorithm 2's P = exp(S - L) on the C fragment s[x..x+3] = (row g, col 2t), (g, 2t+1), (g+8, 2t),
    # (g+8, 2t+1), into s: L (log2 units) is l0 for row g and l1 for row g+8, or (transposed: S^T, whose
    # columns are the queries) l0 for column 2t and l1 for 2t+1
    for e in range(4):
        k = e % 2 if transposed else e // 2
        s[x + e] = math.exp2(s[x + e] * scale_log2 - (l1 if k else l0))


@cuda.jit(device=True, inline=True)
def compute_ds(dp, p, x, d0, d1, transposed):
    # Algorithm 2's dS = P o (dP - D) on the C fragment dp[x..x+3] (dP in, dS out); D as L in recompute_p
    for e in range(4):
        k = e % 2 if transposed else e // 2
        dp[x + e] = p[x + e] * (dp[x + e] - (d1 if k else d0))


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
@cuda.jit(fastmath=True, **launch_bounds(FWD_THREADS, FWD_BLOCKS_PER_SM))
def flash_forward_mma_kernel(out, lse, inp, scale_log2):
    # out (B,T,C/2), inp (B,T,3C/2) words; lse (B,NH,T) float32. Block (query tile of FWD_ROWS, h, b), the
    # longest rows (last query tile) first; warp w: FWD_TILES row tiles from its first row w0, key tiles in
    # order up to the diagonal (Algorithm 1). Overwrites out and lse.
    T, C2 = inp.shape[1], out.shape[2]
    tid, lane, h, b, r0, w0 = block_rows(FWD_ROWS, 16 * FWD_TILES, True)
    hq, hk, hv = h * WORDS, C2 + h * WORDS, 2 * C2 + h * WORDS
    smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer n: K tile 2n, V tile 2n+1
    base = shared_address(smem, 0)
    k_rows, v_trans = rows_address(base, lane), trans_address(base + TILE_BYTES, lane)
    nkt = (min(r0 + FWD_ROWS, T) - 1) // BC + 1     # key tiles up to the block's last row
    load_tiles(base, inp, hk, inp, hv, b, 0, tid, FWD_THREADS)
    qf = cuda.local.array(FWD_A, numba.uint32)  # Q_i: row tile i's A fragments at [A_HS i..]
    o = cuda.local.array(FWD_O, numba.float32)  # O_i at [C_HS i..]
    s = cuda.local.array(FWD_S, numba.float32)  # S, then P~, at [C_BC i..]
    pf = cuda.local.array(FWD_P, numba.uint32)  # P~ as bf16 A fragments
    m = cuda.local.array(FWD_M, numba.float32)  # m and l of the lane's rows, row tile i's at [2i], [2i+1]
    l = cuda.local.array(FWD_M, numba.float32)
    for i in range(FWD_TILES):
        load_fragments(qf, i, inp, b, w0 + 16 * i, hq, lane)
    for x in range(FWD_O):
        o[x] = 0.0
    for x in range(FWD_M):
        m[x], l[x] = NEG, 0.0
    for kt in range(nkt):
        wait_tiles()
        if kt + 1 < nkt:                        # tile kt+1 into the other buffer while tile kt is used
            load_tiles(base + (kt + 1) % 2 * BUF_BYTES, inp, hk, inp, hv, b, (kt + 1) * BC, tid, FWD_THREADS)
        k0, off = kt * BC, kt % 2 * BUF_BYTES
        if k0 < w0 + 16 * FWD_TILES:           # some key of the tile is at or before the warp's last row
            mma_a_bt(s, qf, k_rows + off, FWD_TILES)                  # S = Q K^T
            for i in range(FWD_TILES):
                if k0 + BC - 1 > w0 + 16 * i:  # the tile reaches past the row tile's first row
                    causal_mask(s, i, w0 + 16 * i, k0, lane, T, False, NEG)
            online_softmax(s, o, m, l, FWD_TILES, scale_log2)         # m, P~, l; O rescaled
            pack_a(pf, s, FWD_TILES)
            mma_a_b(o, pf, v_trans + off, FWD_TILES)                  # O += P~ V
    for i in range(FWD_TILES):
        write_o_lse(out, lse, o, m, l, i, b, h, w0 + 16 * i, hq, lane, scale_log2)


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
    w = 1
    while w < CHUNKS:                           # the row's CHUNKS threads: xor 1, 2, 4, ...
        acc += cuda.shfl_xor_sync(FULL, acc, w)
        w *= 2
    if row < B * T * NH and idx % CHUNKS == 0:
        dsum[row // (NH * T), row % NH, row // NH % T] = acc


@cuda.jit(fastmath=True, **launch_bounds(DQ_THREADS, DQ_BLOCKS_PER_SM))
def flash_dq_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # dinp, inp (B,T,3C/2), dout (B,T,C/2) words; lse, dsum (B,NH,T) float32. Block (query tile of DQ_ROWS,
    # h, b), the longest first; warp w: rows w0..w0+15, key tiles in order up to the diagonal:
    #   S = Q K^T, P = exp(S - L), dP = dO V^T, dS = P o (dP - D), dQ += scale dS K
    # (+)= into dinp's q part (accumulate=False: overwrites).
    T, C2 = inp.shape[1], dout.shape[2]
    tid, lane, h, b, r0, w0 = block_rows(DQ_ROWS, 16, True)
    hq, hk, hv = h * WORDS, C2 + h * WORDS, 2 * C2 + h * WORDS
    smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer n: K tile 2n, V tile 2n+1
    base = shared_address(smem, 0)
    k_rows, k_trans = rows_address(base, lane), trans_address(base, lane)
    v_rows = rows_address(base + TILE_BYTES, lane)
    nkt = (min(r0 + DQ_ROWS, T) - 1) // BC + 1
    load_tiles(base, inp, hk, inp, hv, b, 0, tid, DQ_THREADS)
    qf = cuda.local.array(A_HS, numba.uint32)   # Q_i and dO_i as A fragments
    dof = cuda.local.array(A_HS, numba.uint32)
    la, lb, da, db = load_query_rows(qf, dof, inp, dout, lse, dsum, b, h, w0, lane)
    dq = cuda.local.array(C_HS, numba.float32)
    s = cuda.local.array(C_BC, numba.float32)   # S, then P
    dp = cuda.local.array(C_BC, numba.float32)  # dP, then dS
    pf = cuda.local.array(A_BC, numba.uint32)   # dS as bf16 A fragments
    for x in range(C_HS):
        dq[x] = 0.0
    for kt in range(nkt):
        wait_tiles()
        if kt + 1 < nkt:
            load_tiles(base + (kt + 1) % 2 * BUF_BYTES, inp, hk, inp, hv, b, (kt + 1) * BC, tid, DQ_THREADS)
        k0, off = kt * BC, kt % 2 * BUF_BYTES
        if k0 < w0 + 16:                        # some key of the tile is at or before the warp's last row
            mma_a_bt(s, qf, k_rows + off, 1)                          # S = Q K^T
            mma_a_bt(dp, dof, v_rows + off, 1)                        # dP = dO V^T
            for j in range(BC // 8):
                recompute_p(s, 4 * j, la, lb, False, scale_log2)          # P = exp(S - L)
            if k0 + BC - 1 > w0:
                causal_mask(s, 0, w0, k0, lane, T, False, ZERO_F)
            for j in range(BC // 8):
                compute_ds(dp, s, 4 * j, da, db, False)                   # dS = P o (dP - D)
            pack_a(pf, dp, 1)
            mma_a_b(dq, pf, k_trans + off, 1)                         # dQ += dS K
    store_rows(dinp, b, w0, hq, dq, 0, scale, scale, accumulate, lane)


@cuda.jit(fastmath=True, **launch_bounds(DKV_THREADS, DKV_BLOCKS_PER_SM))
def flash_dkv_mma_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
    # As flash_dq_mma_kernel, for dk and dv (Algorithm 2's outer loop): block (key tile of DKV_ROWS, h, b);
    # warp w: keys w0..w0+15, query tiles from the diagonal on: S^T = K Q^T, P^T = exp(S^T - L), dP^T = V dO^T,
    # dS^T = P^T o (dP^T - D), dV += P^T dO, dK += scale dS^T Q. (+)= into dinp's k, v (accumulate=False: =).
    smem = cuda.shared.array(BUF_WORDS, numba.uint32)       # buffer n: Q tile 2n, dO tile 2n+1
    stats = cuda.shared.array(LSE_FLOATS, numba.float32)    # buffer n: L at [2n BC..], D at [(2n+1) BC..]
    T, C2 = inp.shape[1], dout.shape[2]
    tid, lane, h, b, r0, w0 = block_rows(DKV_ROWS, 16, False)
    hq, hk, hv = h * WORDS, C2 + h * WORDS, 2 * C2 + h * WORDS
    base, sbase = shared_address(smem, 0), shared_address(stats, 0)
    q_rows, q_trans = rows_address(base, lane), trans_address(base, lane)
    do_rows, do_trans = rows_address(base + TILE_BYTES, lane), trans_address(base + TILE_BYTES, lane)
    first = r0 // BC                            # the query tile of the block's first key (the diagonal)
    nqt = (T - 1) // BC + 1 - first
    load_stats(sbase, lse, dsum, b, h, first * BC, tid)
    load_tiles(base, inp, hq, dout, hq, b, first * BC, tid, DKV_THREADS)
    kf = cuda.local.array(A_HS, numba.uint32)   # K_j and V_j as A fragments
    vf = cuda.local.array(A_HS, numba.uint32)
    load_fragments(kf, 0, inp, b, w0, hk, lane)
    load_fragments(vf, 0, inp, b, w0, hv, lane)
    dk = cuda.local.array(C_HS, numba.float32)
    dv = cuda.local.array(C_HS, numba.float32)
    s = cuda.local.array(C_BC, numba.float32)   # S^T, then P^T
    dp = cuda.local.array(C_BC, numba.float32)  # dP^T, then dS^T
    pf = cuda.local.array(A_BC, numba.uint32)   # P^T, then dS^T, as bf16 A fragments
    for x in range(C_HS):
        dk[x], dv[x] = 0.0, 0.0
    for n in range(nqt):                        # query tile first+n, in buffer n % 2
        wait_tiles()
        q0, nxt = (first + n) * BC, (n + 1) % 2
        if n + 1 < nqt:
            load_stats(sbase + 8 * BC * nxt, lse, dsum, b, h, q0 + BC, tid)
            load_tiles(base + nxt * BUF_BYTES, inp, hq, dout, hq, b, q0 + BC, tid, DKV_THREADS)
        off, lt = n % 2 * BUF_BYTES, n % 2 * 2 * BC + 2 * (lane % 4)
        if q0 + BC > w0:                        # some query of the tile is at or after the warp's first key
            mma_a_bt(s, kf, q_rows + off, 1)                          # S^T = K Q^T
            mma_a_bt(dp, vf, do_rows + off, 1)                        # dP^T = V dO^T
            for j in range(BC // 8):            # P^T = exp(S^T - L), L of the columns' queries
                l0, l1 = load_at(stats, lt, 8 * j) * LOG2E, load_at(stats, lt, 8 * j + 1) * LOG2E
                recompute_p(s, 4 * j, l0, l1, True, scale_log2)
            if q0 < w0 + 15 or q0 + BC > T:
                causal_mask(s, 0, w0, q0, lane, T, True, ZERO_F)
            for j in range(BC // 8):            # dS^T = P^T o (dP^T - D), D of the columns' queries
                d0, d1 = load_at(stats, lt, BC + 8 * j), load_at(stats, lt, BC + 8 * j + 1)
                compute_ds(dp, s, 4 * j, d0, d1, True)
            pack_a(pf, s, 1)
            mma_a_b(dv, pf, do_trans + off, 1)                        # dV += P^T dO
            pack_a(pf, dp, 1)
            mma_a_b(dk, pf, q_trans + off, 1)                         # dK += dS^T Q
    store_rows(dinp, b, w0, hk, dk, 0, scale, scale, accumulate, lane)
    store_rows(dinp, b, w0, hv, dv, 0, ONE, ONE, accumulate, lane)


# ---- the layer: the tensor-core kernels where they apply, the teaching kernels elsewhere ------------------
def flash_attention_forward(dev, out, lse, inp, num_heads) -> None:
    """As llmz.kernels.flash_attention.flash_attention_forward (the same arguments and contract): bf16 values
    of head size 64 on tensor cores; fp32, fp64 and other head sizes on the teaching kernels (exact, slow:
    fp32 training keeps --attention gemm, cuBLAS TF32, as its default)."""
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


# ---- the same kernels at other compile-time constants ---------------------------------------------------
def compiled_with(**constants) -> types.ModuleType:
    """This file run again as a module of its own with some of its constants set otherwise (HS, BC, a
    kernel's warps, row tiles or launch bound; the constants that follow from them follow): its device
    functions, kernels and launches at another head size or block shape, from this one source (Numba takes a
    function's constants when it compiles it). dev/flash_attention.py builds its versions this way."""
    source = Path(__file__).read_text()
    for name, value in constants.items():
        source, n = re.subn(rf"^{name} = [^#\n]*?(?=\s*#|$)", f"{name} = {value!r}", source, count=1,
                            flags=re.MULTILINE)
        if n != 1:
            raise ValueError(f"{__name__} has no module constant {name}")
    suffix = "".join(f"_{k}{v}" for k, v in constants.items()) or "_copy"
    module = types.ModuleType(f"{__package__}.{Path(__file__).stem}{suffix}")
    module.__package__, module.__file__ = __package__, __file__
    exec(compile(source, __file__, "exec"), module.__dict__)  # noqa: S102 (this file, some constants changed)
    return module
