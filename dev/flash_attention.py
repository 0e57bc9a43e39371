"""Flash attention on tensor cores, version by version (llm.c's dev/cuda role): every version's forward and
backward checked against a float64 reference on fresh random inputs, run twice for the same bits, timed at
GPT-2 small's shape (B=16, T=1024, NH=12, hs=64, bf16), and a table printed last.

    timeout 150 python dev/flash_attention.py          # every version (GPU; ~60-90 s with compilation)
    python dev/flash_attention.py 1 3                  # some versions

version 1: llmz.fast.flash_attention today: 64-row blocks of 4 warps (16 rows a warp); each K/V tile loaded
           global -> registers -> shared a word at a time (V transposed on the way) behind the branch of the
           row check, so the loads of a tile go out one after another (the SASS shows LDG, STS, BRA per row:
           ~20 L2 round trips a tile, nothing to overlap them); fragments read one word a lane (LDS.32).
version 2: the tiles by cp.async (16-byte global -> shared copies that skip the registers and do not make the
           thread wait; a row past T is zero-filled, no branch) into two shared buffers: tile k+1's copies fly
           while tile k's mmas run, one syncthreads a tile. Fragments by ldmatrix .x4 (four 8x8 matrices an
           instruction: a quarter of the shared loads) out of row-major tiles, .trans for the operands read
           down the key axis (V in O += P V; K, Q, dO in dq, dk, dv): no transposed staging, half the shared
           tiles in the backward. D = rowsum(dO * O) with 16-byte loads, 8 lanes a row.
version 3: version 2 with 128-row blocks of 8 warps: each K/V (Q/dO) tile is copied once for twice the rows
           (half the copies and syncthreads per mma); a warp skips the tiles above the diagonal for its 16
           rows, so the bigger diagonal block costs no extra mma.
version 4: version 3's backward with 64-row dk/dv blocks (version 2's, 2 blocks an SM at ~230 registers) and
           128-row dq blocks; the forward of version 3.
version 5: the forward with 32 rows a warp (128-row blocks of 4 warps, FlashAttention-2's shape for hs=64):
           each K/V fragment read from shared memory feeds two mmas (half the ldmatrix per mma), two
           independent mma chains a warp; ~2x the registers (2 blocks an SM). Backward: version 4's.
version 6: version 2 with its 64-row dq kernel bounded to 2 blocks an SM instead of 3 (no spills).
The forward and the backward of a version are independent: the best of each column can be combined.

Each version runs in its own try/except (a compile or launch error is one line and the next version runs);
the device is synchronised after every launch group, so an error is charged to the version that made it.
Checks: out and dinp poisoned (NaN) before each run; bf16 tolerances as tools/flash_check.py (norm-wise
relative error out < 1e-2, dq/dk/dv < 2e-2, lse within 1e-2); shapes B=2 T=1024 NH=12, and NH=3 at T=1030,
65 (partial last tiles), 17 (accumulating onto a random dinp), 1; two runs of the first shape must give
the same bits (no atomics anywhere).
Promotion (after a GPU run; the best forward and the best backward may come from different versions): in
llmz/fast/flash_attention.py, flash_forward_mma_kernel, flash_dq_mma_kernel and flash_dkv_mma_kernel become the
winners' bodies from make_kernels / make_forward_2m as module-level kernels (their constants BR, NT, PASSES
and launch bounds written out; copy_tile replaces stage_rows / stage_transposed), flash_rowsum_kernel becomes
rowsum_v4_kernel, and flash_attention_forward_fast / flash_attention_backward_fast launch them as
forward_with / backward_with below do (grid (ceil_div(T, rows), NH, B), rows and threads of the version).
Kernel sizes: python tools/flash_ptx.py --dev (ptxas registers, spills, shared memory; no GPU needed).
"""
import math
import os
import sys
import time
import traceback

import numba
import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmz.device import ceil_div
from llmz.fast import flash_attention as v1
from llmz.fast.device_helpers import pair_view
from llmz.fast.flash_attention import FULL, HS, LOG2E, NEG, ONE, WORDS, ZERO, store_pair
from llmz.fast.mma import (
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
from llmz.fast.mma import mma_m16n8k16_bf16 as mma

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
BC = 64                     # rows of a streamed tile (keys in forward and dq, queries in dk/dv)
PAD = WORDS + 4             # words a shared row: 144 bytes, 16-byte aligned, rows 4 banks apart
TILE_WORDS = BC * PAD
TILE_BYTES = 4 * TILE_WORDS
CHUNKS = WORDS // 4         # 16-byte chunks in a head's row
BUF_WORDS = 4 * TILE_WORDS  # two buffers of two tiles
LSE_FLOATS = 4 * BC         # dk/dv: two buffers of a tile's lse and D

rows_lane = cuda.jit(device=True, inline=True)(ldmatrix_rows_lane)
trans_lane = cuda.jit(device=True, inline=True)(ldmatrix_trans_lane)
copy_chunk = cuda.jit(device=True, inline=True)(tile_copy_chunk)


def _bounds(threads, blocks):
    return {} if SIM else {"launch_bounds": (threads, blocks)}


# ---- versions 2, 3, 4: cp.async double buffering, ldmatrix fragments -----------------------------------
def make_kernels(warps, fwd_blocks, dq_blocks, dkv_blocks):
    """The forward, dq and dk/dv kernels for blocks of 16*warps rows (warp w: rows 16w..16w+15), streamed
    tiles of BC rows; *_blocks: the blocks an SM each kernel's register budget is bounded for."""
    BR = 16 * warps             # the block's own rows
    NT = 32 * warps
    PASSES = BC * CHUNKS // NT  # 16-byte copies a thread makes for one tile

    @cuda.jit(device=True, inline=True)
    def copy_tile(dst, x, b, r0, w0, T, W, tid):
        # shared tile at byte address dst (BC rows of PAD words) <- words w0..w0+31 of rows r0..r0+BC of x[b]
        # (x (B,T,W) words), rows past T zero-filled; which thread copies what: mma.tile_copy_chunk.
        for i in range(PASSES):
            r, c = copy_chunk(tid, i, NT)
            row = r0 + r
            ok = row < T
            src = (b * T + (row if ok else 0)) * W + w0 + 4 * c
            cp_async16(dst + 4 * (r * PAD + 4 * c), x, src, 16 if ok else 0)

    @cuda.jit(fastmath=True, **_bounds(NT, fwd_blocks))
    def forward(out, lse, inp, scale_log2):
        # out (B,T,C/2), inp (B,T,3C/2) words; lse (B,NH,T) float32. Block (query tile of BR rows, h, b), the
        # longest first. Overwrites out and lse.
        T, W, C2 = inp.shape[1], inp.shape[2], out.shape[2]
        qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        w0 = qt * BR + 16 * warp                    # the warp's first row
        ra = w0 + g
        rb = ra + 8
        hq = h * WORDS
        smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer s: K tile 2s, V tile 2s+1
        base = shared_address(smem, 0)
        ka = base + 4 * rows_lane(lane, PAD)        # the lane's ldmatrix row addresses in buffer 0
        va = base + TILE_BYTES + 4 * trans_lane(lane, PAD)
        nkt = (min(qt * BR + BR, T) - 1) // BC + 1  # key tiles up to the block's last row
        copy_tile(base, inp, b, 0, C2 + hq, T, W, tid)
        copy_tile(base + TILE_BYTES, inp, b, 0, 2 * C2 + hq, T, W, tid)
        cp_async_commit()
        qf = cuda.local.array(16, numba.uint32)     # Q as A fragments (4 k-steps), for the whole kernel
        for kk in range(4):
            qf[4 * kk] = inp[b, ra, hq + 8 * kk + t] if ra < T else ZERO
            qf[4 * kk + 1] = inp[b, rb, hq + 8 * kk + t] if rb < T else ZERO
            qf[4 * kk + 2] = inp[b, ra, hq + 8 * kk + 4 + t] if ra < T else ZERO
            qf[4 * kk + 3] = inp[b, rb, hq + 8 * kk + 4 + t] if rb < T else ZERO
        o = cuda.local.array(32, numba.float32)
        s = cuda.local.array(32, numba.float32)
        pf = cuda.local.array(16, numba.uint32)
        for i in range(32):
            o[i] = 0.0
        ma = numba.float32(NEG)
        mb = numba.float32(NEG)
        la = numba.float32(0.0)
        lb = numba.float32(0.0)
        for kt in range(nkt):
            cp_async_wait(0)
            cuda.syncthreads()                      # tile kt is in; every warp is done with tile kt-1
            if kt + 1 < nkt:                        # its buffer takes tile kt+1 while tile kt is used
                nxt = base + ((kt + 1) % 2) * 2 * TILE_BYTES
                copy_tile(nxt, inp, b, (kt + 1) * BC, C2 + hq, T, W, tid)
                copy_tile(nxt + TILE_BYTES, inp, b, (kt + 1) * BC, 2 * C2 + hq, T, W, tid)
                cp_async_commit()
            k0 = kt * BC
            if k0 <= w0 + 15:                       # some key of the tile is at or before the warp's rows
                off = (kt % 2) * 2 * TILE_BYTES
                # S = Q K^T: ldmatrix gives n-tile j's B fragments for two k-steps
                for i in range(32):
                    s[i] = 0.0
                for kp in range(2):
                    for j in range(8):
                        b0, b1, b2, b3 = ldmatrix_x4(ka + off + 4 * (8 * j * PAD + 16 * kp))
                        s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                            qf[8 * kp], qf[8 * kp + 1], qf[8 * kp + 2], qf[8 * kp + 3], b0, b1,
                            s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                        s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3] = mma(
                            qf[8 * kp + 4], qf[8 * kp + 5], qf[8 * kp + 6], qf[8 * kp + 7], b2, b3,
                            s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3])
                if k0 + BC - 1 > w0:                # the causal mask (keys past T are past every row < T)
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
                xa, xb = ma, mb
                for j in range(8):
                    xa = max(xa, max(s[4 * j], s[4 * j + 1]))
                    xb = max(xb, max(s[4 * j + 2], s[4 * j + 3]))
                xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 1))
                xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 2))
                xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 1))
                xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 2))
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
                sa, sb = ma * scale_log2, mb * scale_log2
                for j in range(8):
                    s[4 * j] = math.exp2(s[4 * j] * scale_log2 - sa)
                    s[4 * j + 1] = math.exp2(s[4 * j + 1] * scale_log2 - sa)
                    s[4 * j + 2] = math.exp2(s[4 * j + 2] * scale_log2 - sb)
                    s[4 * j + 3] = math.exp2(s[4 * j + 3] * scale_log2 - sb)
                    la += s[4 * j] + s[4 * j + 1]
                    lb += s[4 * j + 2] + s[4 * j + 3]
                for kk in range(4):
                    pf[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1])
                    pf[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3])
                    pf[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5])
                    pf[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7])
                # O += P V: ldmatrix .trans gives k-step kk's B fragments for n-tiles 2jp, 2jp+1
                for kk in range(4):
                    for jp in range(4):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(va + off + 4 * (16 * kk * PAD + 8 * jp))
                        o[8 * jp], o[8 * jp + 1], o[8 * jp + 2], o[8 * jp + 3] = mma(
                            pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b0, b1,
                            o[8 * jp], o[8 * jp + 1], o[8 * jp + 2], o[8 * jp + 3])
                        o[8 * jp + 4], o[8 * jp + 5], o[8 * jp + 6], o[8 * jp + 7] = mma(
                            pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], b2, b3,
                            o[8 * jp + 4], o[8 * jp + 5], o[8 * jp + 6], o[8 * jp + 7])
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

    @cuda.jit(fastmath=True, **_bounds(NT, dq_blocks))
    def dq_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
        # dinp, inp (B,T,3C/2), dout (B,T,C/2) words; lse, dsum (B,NH,T) float32. Block (query tile of BR rows,
        # h, b): dq = scale * sum over keys u <= t of dS[t,u] k_u, key tiles in order. (+)= into dinp's q part.
        T, W, C2 = inp.shape[1], inp.shape[2], dout.shape[2]
        qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        w0 = qt * BR + 16 * warp
        ra = w0 + g
        rb = ra + 8
        hq = h * WORDS
        smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer s: K tile 2s, V tile 2s+1
        base = shared_address(smem, 0)
        ka = base + 4 * rows_lane(lane, PAD)
        kta = base + 4 * trans_lane(lane, PAD)
        va = base + TILE_BYTES + 4 * rows_lane(lane, PAD)
        nkt = (min(qt * BR + BR, T) - 1) // BC + 1
        copy_tile(base, inp, b, 0, C2 + hq, T, W, tid)
        copy_tile(base + TILE_BYTES, inp, b, 0, 2 * C2 + hq, T, W, tid)
        cp_async_commit()
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
        s = cuda.local.array(32, numba.float32)
        dp = cuda.local.array(32, numba.float32)
        pf = cuda.local.array(16, numba.uint32)
        for i in range(32):
            dq[i] = 0.0
        for kt in range(nkt):
            cp_async_wait(0)
            cuda.syncthreads()
            if kt + 1 < nkt:
                nxt = base + ((kt + 1) % 2) * 2 * TILE_BYTES
                copy_tile(nxt, inp, b, (kt + 1) * BC, C2 + hq, T, W, tid)
                copy_tile(nxt + TILE_BYTES, inp, b, (kt + 1) * BC, 2 * C2 + hq, T, W, tid)
                cp_async_commit()
            k0 = kt * BC
            if k0 <= w0 + 15:
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

    @cuda.jit(fastmath=True, **_bounds(NT, dkv_blocks))
    def dkv_kernel(dinp, dout, inp, lse, dsum, scale_log2, scale, accumulate):
        # As dq_kernel for dk and dv: block (key tile of BR rows, h, b), the longest (first) first; query
        # tiles of BC from the diagonal on:  S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T,
        # dS^T = P^T (dP^T - D); dv += P^T dO, dk += scale dS^T Q.  (+)= into dinp's k and v parts.
        T, W, C2 = inp.shape[1], inp.shape[2], dout.shape[2]
        NH = lse.shape[1]
        kt = cuda.blockIdx.x
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        w0 = kt * BR + 16 * warp                    # the warp's first key
        ka = w0 + g
        kb = ka + 8
        hq = h * WORDS
        hk, hv = C2 + hq, 2 * C2 + hq
        smem = cuda.shared.array(BUF_WORDS, numba.uint32)     # buffer s: Q tile 2s, dO tile 2s+1
        sld = cuda.shared.array(LSE_FLOATS, numba.float32)            # buffer s: lse at 2s*BC, D at (2s+1)*BC
        base = shared_address(smem, 0)
        lbase = shared_address(sld, 0)
        qa = base + 4 * rows_lane(lane, PAD)
        qta = base + 4 * trans_lane(lane, PAD)
        da_ = base + TILE_BYTES + 4 * rows_lane(lane, PAD)
        dta = base + TILE_BYTES + 4 * trans_lane(lane, PAD)
        lrow = (b * NH + h) * T                     # flat index of lse[b, h, 0] and dsum[b, h, 0]
        first = (kt * BR) // BC
        nqt = (T - 1) // BC + 1

        qf0 = first * BC                            # copy query tile `first` into buffer 0
        copy_tile(base, inp, b, qf0, hq, T, W, tid)
        copy_tile(base + TILE_BYTES, dout, b, qf0, hq, T, C2, tid)
        if tid < 2 * BC:
            i = tid % BC
            ok = qf0 + i < T
            src = lrow + (qf0 + i if ok else 0)
            if tid < BC:
                cp_async4(lbase + 4 * i, lse, src, 4 if ok else 0)
            else:
                cp_async4(lbase + 4 * (BC + i), dsum, src, 4 if ok else 0)
        cp_async_commit()
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
        s = cuda.local.array(32, numba.float32)
        dp = cuda.local.array(32, numba.float32)
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
                copy_tile(nxt, inp, b, q1, hq, T, W, tid)
                copy_tile(nxt + TILE_BYTES, dout, b, q1, hq, T, C2, tid)
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
            if q0 + BC - 1 >= w0:                   # some query of the tile is at or after the warp's keys
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

    return forward, dq_kernel, dkv_kernel


@cuda.jit
def rowsum_v4_kernel(dsum, dout, out):
    # dsum (B,NH,T) float32; dout, out (B,T,C/2) words. dsum[b,h,t] = dout[b,t,h] . out[b,t,h]: 8 threads a
    # (b,t,h) row, each one 16-byte load of each (the row's 128 bytes in one coalesced read), then a
    # three-shuffle sum over the 8 (fixed order). Overwrites dsum.
    B, NH, T = dsum.shape
    idx = cuda.grid(1)
    row = idx // 8                              # (b*T + t)*NH + h: the head's words start at 32*row
    acc = numba.float32(0.0)
    if row < B * T * NH:
        x0, x1, x2, x3 = load4_at(dout, 4 * idx)
        y0, y1, y2, y3 = load4_at(out, 4 * idx)
        acc = (v1.bf16_lo(x0) * v1.bf16_lo(y0) + v1.bf16_hi(x0) * v1.bf16_hi(y0)
               + v1.bf16_lo(x1) * v1.bf16_lo(y1) + v1.bf16_hi(x1) * v1.bf16_hi(y1)
               + v1.bf16_lo(x2) * v1.bf16_lo(y2) + v1.bf16_hi(x2) * v1.bf16_hi(y2)
               + v1.bf16_lo(x3) * v1.bf16_lo(y3) + v1.bf16_hi(x3) * v1.bf16_hi(y3))
    acc += cuda.shfl_xor_sync(FULL, acc, 1)
    acc += cuda.shfl_xor_sync(FULL, acc, 2)
    acc += cuda.shfl_xor_sync(FULL, acc, 4)
    if row < B * T * NH and idx % 8 == 0:
        dsum[row // (NH * T), row % NH, row // NH % T] = acc


# ---- version 5's forward: two row tiles a warp ------------------------------------------------------------
def make_forward_2m(warps, blocks):
    """Version 2's forward with 32 rows a warp (row tiles 32w.., 32w+16..; block 32*warps rows): every K and V
    fragment read from shared memory feeds two mmas, and each warp has two independent mma chains."""
    BR = 32 * warps
    NT = 32 * warps
    PASSES = BC * CHUNKS // NT

    @cuda.jit(device=True, inline=True)
    def copy_tile(dst, x, b, r0, w0, T, W, tid):
        for i in range(PASSES):
            r, c = copy_chunk(tid, i, NT)
            row = r0 + r
            ok = row < T
            src = (b * T + (row if ok else 0)) * W + w0 + 4 * c
            cp_async16(dst + 4 * (r * PAD + 4 * c), x, src, 16 if ok else 0)

    @cuda.jit(device=True, inline=True)
    def softmax_tile(s, o, pf, m, lsum, i, k0, w0, g, t, scale_log2):
        # row tile i of the warp (rows w0 + 16i + g, +8): the causal mask, the online softmax's statistics and
        # O's rescale, P packed to A fragments pf[16i..]
        ra = w0 + 16 * i + g
        rb = ra + 8
        if k0 + BC - 1 > w0 + 16 * i:
            for j in range(8):
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
        xa, xb = m[2 * i], m[2 * i + 1]
        for j in range(8):
            x = 32 * i + 4 * j
            xa = max(xa, max(s[x], s[x + 1]))
            xb = max(xb, max(s[x + 2], s[x + 3]))
        xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 1))
        xa = max(xa, cuda.shfl_xor_sync(FULL, xa, 2))
        xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 1))
        xb = max(xb, cuda.shfl_xor_sync(FULL, xb, 2))
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

    @cuda.jit(fastmath=True, **_bounds(NT, blocks))
    def forward(out, lse, inp, scale_log2):
        # As make_kernels' forward; register arrays hold row tile i at [32i..] (o, s), [16i..] (qf, pf), and the
        # statistics of rows (g, g+8) of row tile i at [2i], [2i+1].
        T, W, C2 = inp.shape[1], inp.shape[2], out.shape[2]
        qt = cuda.gridDim.x - 1 - cuda.blockIdx.x
        h, b = cuda.blockIdx.y, cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        w0 = qt * BR + 32 * warp                    # the warp's first row
        hq = h * WORDS
        smem = cuda.shared.array(BUF_WORDS, numba.uint32)
        base = shared_address(smem, 0)
        ka = base + 4 * rows_lane(lane, PAD)
        va = base + TILE_BYTES + 4 * trans_lane(lane, PAD)
        nkt = (min(qt * BR + BR, T) - 1) // BC + 1
        copy_tile(base, inp, b, 0, C2 + hq, T, W, tid)
        copy_tile(base + TILE_BYTES, inp, b, 0, 2 * C2 + hq, T, W, tid)
        cp_async_commit()
        qf = cuda.local.array(32, numba.uint32)
        for i in range(2):
            ra = w0 + 16 * i + g
            rb = ra + 8
            for kk in range(4):
                qf[16 * i + 4 * kk] = inp[b, ra, hq + 8 * kk + t] if ra < T else ZERO
                qf[16 * i + 4 * kk + 1] = inp[b, rb, hq + 8 * kk + t] if rb < T else ZERO
                qf[16 * i + 4 * kk + 2] = inp[b, ra, hq + 8 * kk + 4 + t] if ra < T else ZERO
                qf[16 * i + 4 * kk + 3] = inp[b, rb, hq + 8 * kk + 4 + t] if rb < T else ZERO
        o = cuda.local.array(64, numba.float32)
        s = cuda.local.array(64, numba.float32)
        pf = cuda.local.array(32, numba.uint32)
        m = cuda.local.array(4, numba.float32)
        lsum = cuda.local.array(4, numba.float32)
        for i in range(64):
            o[i] = 0.0
        for i in range(4):
            m[i] = NEG
            lsum[i] = 0.0
        for kt in range(nkt):
            cp_async_wait(0)
            cuda.syncthreads()
            if kt + 1 < nkt:
                nxt = base + ((kt + 1) % 2) * 2 * TILE_BYTES
                copy_tile(nxt, inp, b, (kt + 1) * BC, C2 + hq, T, W, tid)
                copy_tile(nxt + TILE_BYTES, inp, b, (kt + 1) * BC, 2 * C2 + hq, T, W, tid)
                cp_async_commit()
            k0 = kt * BC
            if k0 <= w0 + 31:
                off = (kt % 2) * 2 * TILE_BYTES
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

    return forward


K64 = make_kernels(4, fwd_blocks=4, dq_blocks=3, dkv_blocks=2)     # version 2
K128 = make_kernels(8, fwd_blocks=2, dq_blocks=1, dkv_blocks=1)    # version 3 (and 4's forward and dq)
F2M = make_forward_2m(4, blocks=2)                                   # version 5's forward
K64B2 = make_kernels(4, fwd_blocks=4, dq_blocks=2, dkv_blocks=2)   # version 6's dq (no spills)


# ---- launches: (dev, arrays) as llmz.fast.flash_attention's -------------------------------------------
SCALE = np.float32(1.0 / math.sqrt(HS))


def _flops(B, NH, T, products):
    return products * B * NH * HS * T * (T + 1)


def forward_with(kernel, rows, threads):
    """The forward launch of `kernel`, blocks of `rows` query rows and `threads` threads."""
    def forward(dev, out, lse, inp, NH):
        B, T, _ = inp.shape
        dev.launch(kernel, (ceil_div(T, rows), NH, B), threads, pair_view(out), lse, pair_view(inp),
                   SCALE * LOG2E, flops=_flops(B, NH, T, 2))
    return forward


def backward_with(dq_kernels, dq_warps, dkv_kernels, dkv_warps):
    def backward(dev, dinp, dout, inp, out, lse, dsum, NH, accumulate):
        B, T, _ = inp.shape
        dout2, inp2, dinp2 = pair_view(dout), pair_view(inp), pair_view(dinp)
        dev.launch(rowsum_v4_kernel, ceil_div(B * T * NH * 8, 256), 256, dsum, dout2, pair_view(out))
        dev.launch(dkv_kernels[2], (ceil_div(T, 16 * dkv_warps), NH, B), 32 * dkv_warps, dinp2, dout2, inp2, lse,
                   dsum, SCALE * LOG2E, SCALE, accumulate, flops=_flops(B, NH, T, 4))
        dev.launch(dq_kernels[1], (ceil_div(T, 16 * dq_warps), NH, B), 32 * dq_warps, dinp2, dout2, inp2, lse,
                   dsum, SCALE * LOG2E, SCALE, accumulate, flops=_flops(B, NH, T, 3))
    return backward


def v1_backward(dev, dinp, dout, inp, out, lse, dsum, NH, accumulate):
    v1.flash_attention_backward_fast(dev, dinp, dout, inp, out, lse, dsum, NH, accumulate)


# version: (what it is, forward, backward)
VERSIONS = {
    1: ("llmz.fast today", v1.flash_attention_forward_fast, v1_backward),
    2: ("cp.async x2 + ldmatrix, 64-row", forward_with(K64[0], 64, 128), backward_with(K64, 4, K64, 4)),
    3: ("as 2, 128-row blocks", forward_with(K128[0], 128, 256), backward_with(K128, 8, K128, 8)),
    4: ("as 3, dk/dv 64-row", forward_with(K128[0], 128, 256), backward_with(K128, 8, K64, 4)),
    5: ("fwd 32 rows a warp; bwd as 4", forward_with(F2M, 128, 128), backward_with(K128, 8, K64, 4)),
    6: ("as 2, dq 2 blocks an SM", forward_with(K64[0], 64, 128), backward_with(K64B2, 4, K64, 4)),
}


# ---- the float64 reference (dense: the whole causal T x T, float64) ---------------------------------------
def reference(x, dy, NH, dinp0=None, xp=np):
    """x (B,T,3C), dy (B,T,C) float64 -> out (B,T,C), lse (B,NH,T), dinp (B,T,3C) (+ dinp0 when given). The
    plain softmax attention and its gradient, checked against llmz's flash reference in main(); xp: numpy,
    or cupy (float64 on the GPU: seconds instead of a minute at B=2 T=1024 NH=12)."""
    B, T, C3 = x.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = (x[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for i in range(3))
    g = dy.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(hs)
    s[..., xp.triu(xp.ones((T, T), dtype=bool), 1)] = -np.inf
    m = s.max(-1, keepdims=True)
    p = xp.exp(s - m)
    lsum = p.sum(-1, keepdims=True)
    p /= lsum
    o = p @ v
    dv = p.swapaxes(-1, -2) @ g
    ds = p * (g @ v.swapaxes(-1, -2) - xp.sum(g * o, -1, keepdims=True))
    dq = ds @ k / math.sqrt(hs)
    dk = ds.swapaxes(-1, -2) @ q / math.sqrt(hs)

    def merge(a):
        return a.transpose(0, 2, 1, 3).reshape(B, T, -1)
    dinp = xp.concatenate([merge(dq), merge(dk), merge(dv)], -1)
    if dinp0 is not None:
        dinp = dinp + dinp0
    return merge(o), (m + xp.log(lsum))[..., 0], dinp


# ---- checks and timings ------------------------------------------------------------------------------------
TOL = {"out": 1e-2, "lse": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}    # tools/flash_check.py's


def errors(got, want, C, dinp0=None):
    """Norm-wise relative errors of out, dq, dk, dv (of what was added, when accumulating onto dinp0) and
    the max |lse error|, as tools/flash_check.py computes them."""
    from llmz.bf16 import bf16_to_f32
    out, lse, dinp = got
    errs = {"out": rel(bf16_to_f32(out), want[0]), "lse": float(np.max(np.abs(lse - want[1])))}
    d, w = bf16_to_f32(dinp).astype(np.float64), want[2]
    if dinp0 is not None:
        base = bf16_to_f32(dinp0).astype(np.float64)
        d, w = d - base, w - base
    floor = 1e-3 * np.linalg.norm(w)
    for i, part in enumerate(("dq", "dk", "dv")):
        x, y = d[..., i * C:(i + 1) * C], w[..., i * C:(i + 1) * C]
        errs[part] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), floor))
    finite = all(np.all(np.isfinite(bf16_to_f32(a))) for a in (out, dinp)) and bool(np.all(np.isfinite(lse)))
    return errs, finite


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def run(dev, version, inp, dout, NH, dinp0=None):
    """One forward + backward of `version` on poisoned outputs: (out bits, lse, dinp bits) on the host."""
    _, forward, backward = VERSIONS[version]
    B, T, C3 = inp.shape
    out = dev.full((B, T, C3 // 3), 0x7FC0, np.uint16)
    lse = dev.full((B, NH, T), np.nan, np.float32)
    dsum = dev.full((B, NH, T), np.nan, np.float32)
    x = dev.asarray(inp)
    forward(dev, out, lse, x, NH)
    dev.synchronize()
    dinp = dev.asarray(dinp0) if dinp0 is not None else dev.full(inp.shape, 0x7FC0, np.uint16)
    backward(dev, dinp, dev.asarray(dout), x, out, lse, dsum, NH, dinp0 is not None)
    dev.synchronize()
    return dev.to_host(out), dev.to_host(lse), dev.to_host(dinp)


def time_ms(dev, fn, reps=10):
    import cupy
    fn()
    dev.synchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(dev.compute_stream.cupy)
    for _ in range(reps):
        fn()
    e1.record(dev.compute_stream.cupy)
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) / reps


def setup(rng):
    """The checked cases (label, inp, dout, NH, dinp0, want) with fresh random bf16 inputs and their float64
    references (on the GPU), after checking the dense reference against llmz's flash reference."""
    import cupy

    from llmz.bf16 import bf16_to_f32, f32_to_bf16
    from llmz.kernels.flash_attention import flash_attention_backward_ref, flash_attention_forward_ref
    x, dy = rng.normal(size=(1, 130, 3 * 2 * HS)), rng.normal(size=(1, 130, 2 * HS))
    o, lse = np.empty((1, 130, 2 * HS)), np.empty((1, 2, 130))
    flash_attention_forward_ref(o, lse, x, 2)
    d = np.zeros(x.shape)
    flash_attention_backward_ref(d, dy, x, o, lse, 2)
    err = max(rel(a, b) for a, b in zip(reference(x, dy, 2), (o, lse, d)))
    print(f"dense float64 reference vs llmz flash reference (B=1 T=130 NH=2): {err:.1e} "
          f"({'PASS' if err < 1e-12 else 'FAIL'})")

    def f64(a):
        return None if a is None else cupy.asarray(bf16_to_f32(a).astype(np.float64))
    cases = []
    for B, T, NH, acc in ((2, 1024, 12, False), (2, 1030, 3, False), (2, 65, 3, False), (2, 17, 3, True),
                          (1, 1, 3, False)):
        C = NH * HS
        inp, dout = f32_to_bf16(rng.normal(size=(B, T, 3 * C))), f32_to_bf16(rng.normal(size=(B, T, C)))
        # accumulating: onto a dinp0 ~10x smaller than 1, so that rounding the sum to bf16 (what the check
        # subtracts dinp0 from) stays well inside the tolerance (onto N(0,1) at T=1030 it alone is 1.6e-2)
        dinp0 = f32_to_bf16(0.1 * rng.normal(size=(B, T, 3 * C))) if acc else None
        want = tuple(cupy.asnumpy(a) for a in reference(f64(inp), f64(dout), NH, f64(dinp0), xp=cupy))
        cases.append((f"B={B} T={T} NH={NH}" + (" +=" if acc else ""), inp, dout, NH, dinp0, want))
    return cases


TIMED = (16, 1024, 12)                          # B, T, NH: GPT-2 small's attention, one layer


def check_and_time(dev, ver, cases, timed):
    """One row of the table: (version, name, fwd ms, bwd ms, worst errors, ok, note)."""
    name, forward, backward = VERSIONS[ver]
    worst, ok, note = {}, True, ""
    for label, inp, dout, NH, dinp0, want in cases:
        got = run(dev, ver, inp, dout, NH, dinp0)
        errs, finite = errors(got, want, NH * HS, dinp0)
        good = finite and all(errs[k] < TOL[k] for k in errs)
        ok &= good
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(f"  v{ver} {label}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
              + ("" if finite else " NON-FINITE") + f" {'PASS' if good else 'FAIL'}", flush=True)
        if label == cases[0][0]:
            same = all(np.array_equal(a, b) for a, b in zip(got, run(dev, ver, inp, dout, NH, dinp0)))
            ok &= same
            note += "" if same else "nondeterministic "
            print(f"  v{ver} {label}: second run {'gives the same bits' if same else 'gives DIFFERENT BITS'}")
    tin, tdout, tout, tlse, tdinp, tdsum = timed
    NH = TIMED[2]
    fwd = time_ms(dev, lambda: forward(dev, tout, tlse, tin, NH))
    bwd = time_ms(dev, lambda: backward(dev, tdinp, tdout, tin, tout, tlse, tdsum, NH, False))
    return ver, name, fwd, bwd, worst, ok, note


def context_alive(dev):
    """False after a sticky CUDA error (an illegal address poisons the whole context)."""
    try:
        dev.synchronize()
        dev.to_host(dev.full((4,), 1.0, np.float32))
        return True
    except Exception:  # noqa: BLE001 (any failure here means the context is gone)
        return False


def run_versions(versions):
    """Check and time `versions` in this process; after a sticky CUDA error, the rest in a fresh process.
    Returns the table's rows."""
    import json
    import subprocess

    from llmz.bf16 import f32_to_bf16
    from llmz.device import Device
    dev = Device("gpu", np.uint16, matmul="cublas", attention="flash")
    rng = np.random.default_rng()
    cases = setup(rng)
    B, T, NH = TIMED
    C = NH * HS
    timed = (dev.asarray(f32_to_bf16(rng.normal(size=(B, T, 3 * C)))),
             dev.asarray(f32_to_bf16(rng.normal(size=(B, T, C)))),
             dev.zeros((B, T, C)), dev.zeros((B, NH, T), np.float32), dev.zeros((B, T, 3 * C)),
             dev.zeros((B, NH, T), np.float32))
    rows = []
    for i, ver in enumerate(versions):
        t0 = time.time()
        try:
            row = check_and_time(dev, ver, cases, timed)
        except Exception as e:  # noqa: BLE001 (one line, then the next version)
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            row = (ver, VERSIONS[ver][0], float("nan"), float("nan"), {}, False, f"{type(e).__name__}: {msg}")
            print(f"v{ver} FAILED: {row[6]}", flush=True)
            traceback.print_exc(limit=2)
            if not context_alive(dev) and versions[i + 1:]:
                print(f"(the CUDA context is gone: versions {versions[i + 1:]} in a fresh process)", flush=True)
                rows.append(row)
                r = subprocess.run([sys.executable, __file__, "--child", *map(str, versions[i + 1:])],
                                   capture_output=True, text=True, check=False)
                print(r.stderr[-3000:] if r.returncode else "", end="")
                for line in r.stdout.splitlines():
                    if line.startswith("ROW "):
                        rows.append(tuple(json.loads(line[4:])))
                    else:
                        print(line)
                return rows
        rows.append(row)
        print(f"v{ver} {row[1]}: forward {row[2]:.3f} ms, backward {row[3]:.3f} ms ({time.time() - t0:.1f} s)",
              flush=True)
    return rows


def time_sdpa():
    """(name, forward ms, backward ms) of PyTorch's SDPA at the timed shape, or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
        B, T, NH = TIMED
        q, k, v = (torch.randn(B, NH, T, HS, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(B, NH, T, HS, device="cuda", dtype=torch.bfloat16)

        def tm(fn, reps=10):
            fn()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1) / reps
        f = tm(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        both = tm(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g))
        return f"torch {torch.__version__} SDPA", f, both - f
    except Exception as e:  # noqa: BLE001
        print(f"(no torch SDPA timing: {type(e).__name__}: {e})")
        return None


def registers():
    """Registers a thread of each compiled dev kernel (what the GPU's driver reports)."""
    regs = []
    kernels = [("v2", k) for k in K64] + [("v3", k) for k in K128] + [("v5", F2M), ("v6", K64B2[1])]
    for ver, k in kernels:
        try:
            n = k.get_regs_per_thread()
            regs.append(f"{ver} {k.py_func.__name__} {max(n.values()) if isinstance(n, dict) else n}")
        except Exception as e:  # noqa: BLE001 (not compiled: the version did not run)
            regs.append(f"{ver} {k.py_func.__name__} ({type(e).__name__})")
    return "registers a thread: " + ", ".join(regs)


def main(argv) -> int:
    import json
    t_start = time.time()
    child = "--child" in argv
    versions = [int(a) for a in argv if a != "--child"] or sorted(VERSIONS)
    sdpa = None if child else time_sdpa()      # first: a version that breaks the context cannot stop it
    rows = run_versions(versions)
    if child:                                   # rows for the parent, one JSON line each
        for row in rows:
            print("ROW " + json.dumps(row))
        return 0
    B, T, NH = TIMED
    unit = B * NH * HS * T * (T + 1)            # one causal product's flops
    print(f"\nflash attention, bf16, B={B} T={T} NH={NH} hs={HS}; TFLOP/s of the causal products (fwd 2, bwd 5); "
          f"errors: worst over the checked shapes ({time.time() - t_start:.0f} s in all)")
    print(f"{'version':<36}{'fwd ms':>8}{'bwd ms':>8}{'fwd TF':>8}{'bwd TF':>8}{'x12 ms':>8}"
          f"{'out':>8}{'dq':>8}{'dk':>8}{'dv':>8}{'lse':>8}   result")
    for ver, name, f, b, w, ok, note in rows:
        errs = "".join(f"{w.get(k, float('nan')):8.1e}" for k in ("out", "dq", "dk", "dv", "lse"))
        print(f"{f'{ver} {name}'[:35]:<36}{f:8.3f}{b:8.3f}{2 * unit / f / 1e9:8.0f}{5 * unit / b / 1e9:8.0f}"
              f"{12 * (f + b):8.2f}{errs}   {'PASS' if ok else 'FAIL'} {note}")
    if sdpa:
        name, f, b = sdpa
        print(f"{name[:35]:<36}{f:8.3f}{b:8.3f}{2 * unit / f / 1e9:8.0f}{5 * unit / b / 1e9:8.0f}{12 * (f + b):8.2f}")
    print(registers())
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
