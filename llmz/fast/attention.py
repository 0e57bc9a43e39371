"""Attention's fast path: llm.c's non-cuDNN attention (llmc/attention.cuh). The math, shapes and dtypes are
llmz/kernels/attention.py's; with dev.attention == 'gemm' (--attention; it needs cuBLAS) it replaces the
teaching kernels there:

  products  the scores kernel (preatt, datt), the values kernel and the dinp kernel (one thread per output
            element, a dot product each) become batches of B*NH cuBLAS products (llmz.fast.gemm.gemm_heads),
            reading each head straight out of the (B,T,3C) layout: no head-major copies. The products skip
            the causal square's blocks above the diagonal: CAUSAL_BLOCKS row blocks, the block of rows
            [t0, t1) meeting only keys [0, t1) (the later keys have att = 0, dpreatt = 0)
  softmax   attention_softmax_kernel and attention_softmax_backward_kernel (one thread per row) become one
            warp per row, 8 rows per block, on words of two elements (float32 and bf16, T even): the forward
            holds its row in registers (T <= 1024) and reads it once (max and sum together: online softmax,
            float32 exponentials), or loops over it in chunks of 128 words; the lanes meet in the warp
            butterflies of llmz.fast.device_helpers. Odd T (or float64) takes the teaching kernels.
upper_is_zero: att and dpreatt already hold +0.0 above the diagonal (zeroed once, written only here); the
paired kernels then leave that quarter of the bytes unwritten. preatt and datt are defined on and below
the diagonal only.
Contract: fp32 products (--no-tf32) within 1e-5 relative (normwise) of the float64 reference, as the
teaching kernels; TF32 ~1e-3; the softmax kernels within 1e-6 of float64 (float32 exponentials and sums in
a fixed order: the same bits every run).
"""
import itertools
import math

import numba
import numpy as np
from numba import cuda

from ..kernels import attention as teaching
from ..kernels.attention import attention_softmax_backward_kernel, attention_softmax_kernel
from ..kernels.grid import ceil_div
from .device_helpers import load_pair, loads_barrier, pair_view, store_pair, warp_max_sum, warp_row, warp_sum
from .gemm import Heads, gemm_heads

ROWS_PER_BLOCK = 8                      # warps (rows) per block of the softmax kernels
UNROLL = 4                              # words a lane loads per iteration, before it computes with any
CHUNK = 32 * UNROLL                     # words of a row a warp reads per iteration
NINF32, ZERO32 = np.float32(-np.inf), np.float32(0.0)


# ---- the softmax, one warp per row, on words of two elements ----------------------------------------------
# Rows of bf16 as uint32 words, of float32 as uint64 words (pair_view), word w = elements 2w and 2w+1: T must
# be even. A lane takes words w, w+32, w+64, w+96 per iteration (8 elements), all loaded before any math: a
# row is only T elements, and one 2-byte load per lane per iteration keeps too few bytes in flight.
@cuda.jit(device=True)
def _pair_at(a, r, t, w, last, fill):
    """Elements 2w and 2w+1 of row a[r, t] (a paired view) as float32, each one past `last` read as fill."""
    if 2 * w > last:
        return fill, fill
    x0, x1 = load_pair(a, (r, t, w))
    return numba.float32(x0), (numba.float32(x1) if 2 * w + 1 <= last else fill)


@cuda.jit(device=True)
def _tril_pair(a, r, t, w, v0, v1, zero):
    """Store (v0, v1) into word w of row a[r, t] (a paired view), 0 for elements above the diagonal t."""
    store_pair(a, (r, t, w), v0 if 2 * w <= t else zero, v1 if 2 * w + 1 <= t else zero)


# _square_row and _chunk_at are inlined by Numba (inline="always"), before LLVM sees the kernel: the kernels
# then compile to the PTX of the same lines written out in each (as plain device functions LLVM inlines them
# later and orders the address arithmetic differently: tools/compile_check.py --ptx-dir shows it).
@cuda.jit(device=True, inline="always")
def _square_row(a, row):
    """(r, t): warp_row's row of the (R,T,T/2) paired view a as row t of square r."""
    r = row // a.shape[1]
    return r, row - r * a.shape[1]


@cuda.jit(device=True, inline="always")
def _chunk_at(a, r, t, w, last, fill):
    """A lane's 8 elements of an iteration: words w, w+32, w+64, w+96 of row a[r, t] (_pair_at each), all four
    loads issued together."""
    x0, x1 = _pair_at(a, r, t, w, last, fill)
    x2, x3 = _pair_at(a, r, t, w + 32, last, fill)
    x4, x5 = _pair_at(a, r, t, w + 64, last, fill)
    x6, x7 = _pair_at(a, r, t, w + 96, last, fill)
    return x0, x1, x2, x3, x4, x5, x6, x7


@cuda.jit
def softmax_rows_pairs_kernel(att, preatt, write_upper):
    """att, preatt: (R,T,T/2) paired views of (R,T,T) rows. One warp per row, lane l taking words l, l+32, ...
    Overwrites att on and below the diagonal; above it writes +0.0 if write_upper, else leaves it (the
    caller's att already holds the zeros: a quarter of the kernel's bytes not moved)."""
    row, lane = warp_row()
    if row >= att.shape[0] * att.shape[1]:
        return
    r, t = _square_row(att, row)
    # online max and sum over t2 <= t: words w <= t // 2, eight elements per lane per iteration
    m = NINF32
    s = ZERO32
    for w in range(lane, t // 2 + 1, CHUNK):
        x0, x1, x2, x3, x4, x5, x6, x7 = _chunk_at(preatt, r, t, w, t, NINF32)
        mx = max(max(max(x0, x1), max(x2, x3)), max(max(x4, x5), max(x6, x7)))     # x0 <= t: finite
        if mx > m:
            s *= math.exp(m - mx)
            m = mx
        s += ((math.exp(x0 - m) + math.exp(x1 - m)) + (math.exp(x2 - m) + math.exp(x3 - m))) + \
             ((math.exp(x4 - m) + math.exp(x5 - m)) + (math.exp(x6 - m) + math.exp(x7 - m)))
    m, s = warp_max_sum(m, s)
    inv = numba.float32(1.0) / s
    # normalise: the loads of the iteration first, then its stores; 0 above the diagonal (the words up to
    # the diagonal's only, unless write_upper)
    end = att.shape[2] if write_upper else t // 2 + 1
    for w in range(lane, end, CHUNK):
        x0, x1, x2, x3, x4, x5, x6, x7 = _chunk_at(preatt, r, t, w, t, NINF32)
        _tril_pair(att, r, t, w, math.exp(x0 - m) * inv, math.exp(x1 - m) * inv, ZERO32)
        if w + 32 < end:
            _tril_pair(att, r, t, w + 32, math.exp(x2 - m) * inv, math.exp(x3 - m) * inv, ZERO32)
        if w + 64 < end:
            _tril_pair(att, r, t, w + 64, math.exp(x4 - m) * inv, math.exp(x5 - m) * inv, ZERO32)
        if w + 96 < end:
            _tril_pair(att, r, t, w + 96, math.exp(x6 - m) * inv, math.exp(x7 - m) * inv, ZERO32)


@cuda.jit
def softmax_rows_backward_pairs_kernel(dpreatt, datt, att, write_upper):
    """Paired views (R,T,T/2), one warp per row as softmax_rows_pairs_kernel. Overwrites dpreatt on and below
    the diagonal; above it as softmax_rows_pairs_kernel does att."""
    row, lane = warp_row()
    if row >= att.shape[0] * att.shape[1]:
        return
    r, t = _square_row(att, row)
    # sum over t2 <= t of att * datt
    s = ZERO32
    for w in range(lane, t // 2 + 1, CHUNK):
        a0, a1, a2, a3, a4, a5, a6, a7 = _chunk_at(att, r, t, w, t, ZERO32)
        d0, d1, d2, d3, d4, d5, d6, d7 = _chunk_at(datt, r, t, w, t, ZERO32)
        s += ((a0 * d0 + a1 * d1) + (a2 * d2 + a3 * d3)) + ((a4 * d4 + a5 * d5) + (a6 * d6 + a7 * d7))
    total = warp_sum(s)
    # dpreatt = att * (datt - total) on and below the diagonal, 0 above (up to the diagonal's word only,
    # unless write_upper)
    end = att.shape[2] if write_upper else t // 2 + 1
    for w in range(lane, end, CHUNK):
        a0, a1, a2, a3, a4, a5, a6, a7 = _chunk_at(att, r, t, w, t, ZERO32)
        d0, d1, d2, d3, d4, d5, d6, d7 = _chunk_at(datt, r, t, w, t, ZERO32)
        _tril_pair(dpreatt, r, t, w, a0 * (d0 - total), a1 * (d1 - total), ZERO32)
        if w + 32 < end:
            _tril_pair(dpreatt, r, t, w + 32, a2 * (d2 - total), a3 * (d3 - total), ZERO32)
        if w + 64 < end:
            _tril_pair(dpreatt, r, t, w + 64, a4 * (d4 - total), a5 * (d5 - total), ZERO32)
        if w + 96 < end:
            _tril_pair(dpreatt, r, t, w + 96, a6 * (d6 - total), a7 * (d7 - total), ZERO32)


# The paired forward again with the row held in registers (T <= 2 * 32 * WORDS_PER_LANE = 1024: d12's T):
# lane l loads words l, l+32, ..., l+480 of the row, the ones on or below the diagonal, every load issued
# before any arithmetic. The loop kernel above waits for memory once per iteration of 128 words and reads
# the row twice (max and sum, then the write); this one waits once per row and reads it once. Each lane
# combines its own values first (its max, then its sum against that max), then the lanes as above. (The
# backward the same way, att and datt in registers, ran slower than its loop kernel: BENCHMARKS.md.)
WORDS_PER_LANE = 16
VALUES_PER_LANE = 2 * WORDS_PER_LANE       # the elements of those words


@cuda.jit
def softmax_rows_pairs_regs_kernel(att, preatt, write_upper):
    """att, preatt: (R,T,T/2) paired views, T <= 64 * WORDS_PER_LANE. As softmax_rows_pairs_kernel."""
    row, lane = warp_row()
    if row >= att.shape[0] * att.shape[1]:
        return
    r, t = _square_row(att, row)
    # the row on and below the diagonal, all loads in flight at once (-inf past it)
    x = cuda.local.array(VALUES_PER_LANE, numba.float32)
    for k in range(WORDS_PER_LANE):
        x[2 * k], x[2 * k + 1] = _pair_at(preatt, r, t, lane + 32 * k, t, NINF32)
    loads_barrier()
    # this lane's max, and its sum of exp(x - max) (a lane with no element: max -inf, sum 0)
    m = NINF32
    for k in range(VALUES_PER_LANE):
        m = max(m, x[k])
    base = m if m != NINF32 else ZERO32
    s = ZERO32
    for k in range(VALUES_PER_LANE):
        s += math.exp(x[k] - base)
    # the row's max and 1 / sum, in every lane
    m, s = warp_max_sum(m, s)
    inv = numba.float32(1.0) / s
    # att = exp(x - max) / sum on and below the diagonal, 0 above (up to the diagonal's word, or all W)
    end = att.shape[2] if write_upper else t // 2 + 1
    for k in range(WORDS_PER_LANE):
        w = lane + 32 * k
        if w < end:
            _tril_pair(att, r, t, w, math.exp(x[2 * k] - m) * inv, math.exp(x[2 * k + 1] - m) * inv, ZERO32)


def _pairs_ok(*xs) -> bool:
    """The paired kernels apply: float32 or bf16 rows of even length (the views need it)."""
    return all(x.dtype in (np.float32, np.uint16) and x.shape[-1] % 2 == 0 for x in xs)


def softmax_rows(dev, att3, pre3, upper_is_zero: bool = False) -> None:
    """att3 = causal softmax of each row of pre3, both (R,T,T). upper_is_zero: att3 already holds +0.0 above
    the diagonal (a buffer zeroed once that only this function writes); the paired kernel then leaves it."""
    R, T, _ = att3.shape
    if not _pairs_ok(att3, pre3):
        dev.launch(attention_softmax_kernel, ceil_div(R * T, dev.block_size), dev.block_size,
                   att3.reshape(1, R, T, T), pre3.reshape(1, R, T, T))
        return
    kernel = softmax_rows_pairs_regs_kernel if T <= 64 * WORDS_PER_LANE else softmax_rows_pairs_kernel
    dev.launch(kernel, ceil_div(R * T, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK,
               pair_view(att3), pair_view(pre3), not upper_is_zero)


def softmax_rows_backward(dev, dpre3, datt3, att3, upper_is_zero: bool = False) -> None:
    """dpre3 = softmax backward of datt3 given att3, all (R,T,T); upper_is_zero for dpre3 as in softmax_rows."""
    R, T, _ = att3.shape
    if not _pairs_ok(dpre3, datt3, att3):
        dev.launch(attention_softmax_backward_kernel, ceil_div(R * T, dev.block_size), dev.block_size,
                   dpre3.reshape(1, R, T, T), datt3.reshape(1, R, T, T), att3.reshape(1, R, T, T))
        return
    dev.launch(softmax_rows_backward_pairs_kernel, ceil_div(R * T, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK,
               pair_view(dpre3), pair_view(datt3), pair_view(att3), not upper_is_zero)


# ---- the products: cuBLAS over per-head addresses -------------------------------------------------------
def _row_heads(x, NH, parts=1):
    """x (B,T,parts*C) as `parts` lists of B*NH matrices (T, hs) in place (no copies: cuBLAS reads and writes
    them there): q, k, v out of the qkv activation (parts=3), or the heads of a (B,T,C) array side by side."""
    B, T, W = x.shape
    C = W // parts
    hs = C // NH
    return [Heads(x, i * C, T * W, hs, W, T, hs, B, NH) for i in range(parts)]


def _square_heads(x, NH):
    """(B,NH,T,T) as B*NH matrices (T,T)."""
    B, _, T, _ = x.shape
    return Heads(x, 0, NH * T * T, T * T, T, T, T, B, NH)


# The products over the causal T x T square skip its blocks above the diagonal: the rows go in CAUSAL_BLOCKS
# blocks, and the block of rows [t0, t1) meets only keys [0, t1). With 2 blocks the products cover 3/4 of the
# square, with 4 blocks 10/16, in 2 or 4 calls each instead of one (2 measured best: BENCHMARKS.md).
CAUSAL_BLOCKS = 2


def _causal_blocks(T: int) -> list:
    """(t0, t1) of the row blocks of a causal T x T product."""
    n = min(CAUSAL_BLOCKS, T)
    edges = [T * i // n for i in range(n + 1)]
    return list(itertools.pairwise(edges))


def attention_forward_heads(dev, out, preatt, att, inp, num_heads, upper_is_zero=False) -> None:
    """The gemm path on cuBLAS: every product reads its head straight out of inp and writes into out
    (gemmBatchedEx over per-head addresses, llmz.fast.gemm.Heads). Overwrites out, att, and preatt on
    and below the diagonal (upper_is_zero: see softmax_rows)."""
    B, T, C3 = inp.shape
    C = C3 // 3
    NH, hs = num_heads, C // num_heads
    q, k, v = _row_heads(inp, NH, 3)
    pre, at = _square_heads(preatt, NH), _square_heads(att, NH)
    (y,) = _row_heads(out, NH)
    # preatt = q @ k.T / sqrt(hs): rows [t0, t1) against keys [0, t1)
    for t0, t1 in _causal_blocks(T):
        gemm_heads(dev, pre.part(t0, t1 - t0, 0, t1), q.part(t0, t1 - t0, 0, hs), k.part(0, t1, 0, hs),
                   False, True, False, alpha=1.0 / math.sqrt(hs))
    # att = causal softmax of each row
    softmax_rows(dev, att.reshape(B * NH, T, T), preatt.reshape(B * NH, T, T), upper_is_zero)
    # out (head h's columns) = att @ v: rows [t0, t1) from values [0, t1)
    for t0, t1 in _causal_blocks(T):
        gemm_heads(dev, y.part(t0, t1 - t0, 0, hs), at.part(t0, t1 - t0, 0, t1), v.part(0, t1, 0, hs),
                   False, False, False)


def attention_backward_heads(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate=True,
                             upper_is_zero=False) -> None:
    """Backward of attention_forward_heads. Accumulates (+=) into dinp (cuBLAS beta=1; accumulate=False:
    overwrites, beta=0); overwrites dpreatt (upper_is_zero: see softmax_rows), and datt on and below the
    diagonal."""
    B, T, C = dout.shape
    NH, hs = num_heads, C // num_heads
    q, k, v = _row_heads(inp, NH, 3)
    dq, dk, dv = _row_heads(dinp, NH, 3)
    at, dat, dpre = _square_heads(att, NH), _square_heads(datt, NH), _square_heads(dpreatt, NH)
    (dy,) = _row_heads(dout, NH)
    blocks = _causal_blocks(T)
    # through y = att @ v: datt = dy @ v.T (rows [t0, t1), keys [0, t1)); dv (+)= att.T @ dy (keys [t0, t1)
    # from the rows [t0, T) that see them)
    for t0, t1 in blocks:
        gemm_heads(dev, dat.part(t0, t1 - t0, 0, t1), dy.part(t0, t1 - t0, 0, hs), v.part(0, t1, 0, hs),
                   False, True, False)
    for t0, t1 in blocks:
        gemm_heads(dev, dv.part(t0, t1 - t0, 0, hs), at.part(t0, T - t0, t0, t1 - t0), dy.part(t0, T - t0, 0, hs),
                   True, False, accumulate)
    # softmax backward, row by row
    R = B * NH
    softmax_rows_backward(dev, dpreatt.reshape(R, T, T), datt.reshape(R, T, T), att.reshape(R, T, T),
                          upper_is_zero)
    # through preatt = q @ k.T * scale: dq (+)= dpreatt @ k * scale, dk (+)= dpreatt.T @ q * scale, blocked
    # as dv and datt
    scale = 1.0 / math.sqrt(hs)
    for t0, t1 in blocks:
        gemm_heads(dev, dq.part(t0, t1 - t0, 0, hs), dpre.part(t0, t1 - t0, 0, t1), k.part(0, t1, 0, hs),
                   False, False, accumulate, alpha=scale)
    for t0, t1 in blocks:
        gemm_heads(dev, dk.part(t0, t1 - t0, 0, hs), dpre.part(t0, T - t0, t0, t1 - t0),
                   q.part(t0, T - t0, 0, hs), True, False, accumulate, alpha=scale)


# ---- the layer ---------------------------------------------------------------------------------
def attention_forward(dev, out, preatt, att, inp, num_heads, upper_is_zero=False) -> None:
    """inp (B,T,3C) -> out (B,T,C); preatt, att (B,NH,T,T) kept for backward. Overwrites out, att, and preatt
    (on and below the diagonal; upper_is_zero: see softmax_rows). dev.attention 'gemm': cuBLAS products and
    the warp softmax; 'direct': the teaching kernels."""
    if dev.attention != "gemm":
        return teaching.attention_forward(dev, out, preatt, att, inp, num_heads, upper_is_zero)
    attention_forward_heads(dev, out, preatt, att, inp, num_heads, upper_is_zero)


def attention_backward(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate=True,
                       upper_is_zero=False) -> None:
    """dout (B,T,C) -> dinp (B,T,3C): accumulates (+=; accumulate=False: overwrites). dpreatt, datt
    (B,NH,T,T): scratch, overwritten (upper_is_zero for dpreatt as attention_forward's for att)."""
    if dev.attention != "gemm":
        return teaching.attention_backward(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate,
                                           upper_is_zero)
    attention_backward_heads(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate, upper_is_zero)
