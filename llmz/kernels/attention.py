"""Causal multi-head self-attention, as llm.c's train_gpt2.c attention_forward / attention_backward:

    inp (B,T,3C) holds q | k | v for every position; head h is channels h*hs:(h+1)*hs of each, hs = C / NH
    preatt[b,h,t,t2] = q[b,t,h] . k[b,t2,h] / sqrt(hs)       for t2 <= t, 0 above the diagonal
    att[b,h,t,:]     = softmax of preatt[b,h,t,:t+1]          (max-subtracted), 0 above the diagonal
    out[b,t,h]       = sum over t2 of att[b,h,t,t2] v[b,t2,h]

Backward (softmax backward: dpreatt = att * (datt - sum_t2 att datt)):
    datt = dout . v,  dv += att^T dout,  dq += dpreatt @ k / sqrt(hs),  dk += dpreatt^T @ q / sqrt(hs)

Unlike llm.c's CPU version, which accumulates into dpreatt and datt, attention_backward OVERWRITES them:
they are scratch for this call only. dinp accumulates (+=) as in llm.c.

Two ways to compute it on a GPU (dev.attention):
  direct  one teaching kernel per line of the math above, one thread per output element.
  gemm    llm.c's non-cuDNN path (llmc/attention.cuh): split q, k, v into head-major (B,NH,T,hs) arrays,
          then every product above is a batch of B*NH matrix products (llmz.kernels.gemm: cuBLAS, or the
          tiled kernel in the simulator), and the softmax and its backward are one block per row of att.
          The products compute the whole T x T square; the softmax writes 0 above the diagonal, so the
          wasted upper half never reaches the output. preatt is only defined on and below the diagonal.
          On cuBLAS the products read each head straight out of the (B,T,3C) layout (per-head addresses,
          gemmBatchedEx) and the softmax is one warp per row (shuffles): no head-major copies at all.

Arrays may be float32, float64 or uint16 (bf16 bits, computed in float32, results rounded to nearest), each
on its own: the kernels read and write them through llmz.kernels.bf16's load / store / store_add, and the
float32/float64 kernels compute exactly as before. In bf16 the direct softmax kernel rounds twice (att holds
the unnormalised exponentials before it is scaled in place), the other kernels round once per element.
"""
import itertools
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, load_pair, pair_view, store, store_add, store_pair
from .fill import zero
from .gelu import loads_barrier
from .gemm import Heads, gemm, gemm_heads
from .norm import MAX_BLOCK, block_max, block_sum


# ---- NumPy reference ----------------------------------------------------------------------------
def _split_heads(inp, num_heads):
    """inp (B,T,3C) -> q, k, v, each a (B,NH,T,hs) view."""
    B, T, C3 = inp.shape
    qkv = inp.reshape(B, T, 3, num_heads, C3 // 3 // num_heads)
    return (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def attention_forward_ref(out, preatt, att, inp, num_heads):
    """inp (B,T,3C); preatt, att (B,NH,T,T); out (B,T,C). Overwrites out, preatt and att."""
    if is_bf16(out) or is_bf16(preatt) or is_bf16(att) or is_bf16(inp):
        return run_in_f32(lambda o, p, a, i: attention_forward_ref(o, p, a, i, num_heads),
                          (out, preatt, att, inp), written=(0, 1, 2))
    B, T, C3 = inp.shape
    C = C3 // 3
    scale = 1.0 / math.sqrt(C // num_heads)
    q, k, v = _split_heads(inp, num_heads)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)                  # t2 > t
    # scaled scores q.k / sqrt(hs); 0 above the diagonal
    np.matmul(q, k.swapaxes(-1, -2), out=preatt)
    preatt *= scale
    preatt[..., future] = 0
    # softmax over t2 <= t, max-subtracted; exp(-inf) makes the entries above the diagonal exactly 0
    att[...] = preatt
    att[..., future] = -np.inf
    att -= att.max(axis=-1, keepdims=True)
    np.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    # weighted sum of the values, heads back side by side
    out[...] = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)


def attention_backward_ref(dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate=True):
    """dout (B,T,C); inp, dinp (B,T,3C); att, dpreatt, datt (B,NH,T,T).
    Accumulates (+=) into dinp (accumulate=False: overwrites); overwrites dpreatt and datt (scratch)."""
    arrays = (dinp, dpreatt, datt, dout, inp, att)
    if any(is_bf16(x) for x in arrays):
        return run_in_f32(lambda *xs: attention_backward_ref(*xs, num_heads, accumulate), arrays,
                          written=(0, 1, 2))
    if not accumulate:
        dinp[...] = 0
    B, T, C3 = inp.shape
    C = C3 // 3
    scale = 1.0 / math.sqrt(C // num_heads)
    q, k, v = _split_heads(inp, num_heads)
    do = dout.reshape(B, T, num_heads, C // num_heads).transpose(0, 2, 1, 3)    # (B,NH,T,hs)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)                  # t2 > t

    def merge(x):                                                               # (B,NH,T,hs) -> (B,T,C)
        return x.transpose(0, 2, 1, 3).reshape(B, T, C)
    # through the weighted sum of values: datt = dout . v (0 above the diagonal), dv += att^T dout
    np.matmul(do, v.swapaxes(-1, -2), out=datt)
    datt[..., future] = 0
    dinp[..., 2 * C:] += merge(att.swapaxes(-1, -2) @ do)
    # softmax backward; att is 0 above the diagonal, so dpreatt is too
    dpreatt[...] = att * (datt - (att * datt).sum(axis=-1, keepdims=True))
    # through the scores: dq += dpreatt @ k * scale, dk += dpreatt^T @ q * scale
    dinp[..., :C] += merge(dpreatt @ k) * scale
    dinp[..., C:2 * C] += merge(dpreatt.swapaxes(-1, -2) @ q) * scale


# ---- Numba kernels ------------------------------------------------------------------------------
@cuda.jit
def attention_scores_kernel(scores, x, x_off, y, y_off, hs, scale):
    # scores (B,NH,T,T); x (B,T,*), y (B,T,*), head h of x being channels x_off + h*hs : x_off + (h+1)*hs (y alike).
    # scores[b,h,t,t2] = scale * x[b,t,h] . y[b,t2,h] for t2 <= t, 0 above the diagonal. Overwrites scores.
    # Forward: preatt from q and k; backward: datt from dout and v. One thread per element of scores.
    B, NH, T, _ = scores.shape
    idx = cuda.grid(1)
    if idx < B * NH * T * T:
        t2 = idx % T
        t = idx // T % T
        h = idx // (T * T) % NH
        b = idx // (T * T * NH)
        if t2 <= t:
            # dot product over the head's channels
            acc = 0.0
            for i in range(h * hs, (h + 1) * hs):
                acc += load(x, (b, t, x_off + i)) * load(y, (b, t2, y_off + i))
            store(scores, (b, h, t, t2), scale * acc)
        else:
            store(scores, (b, h, t, t2), 0.0)


@cuda.jit
def attention_softmax_kernel(att, preatt):
    # att, preatt (B,NH,T,T). att[b,h,t,:] = softmax of preatt[b,h,t,:t+1], 0 above the diagonal. Overwrites att.
    # One thread per row (b,h,t).
    B, NH, T, _ = att.shape
    row = cuda.grid(1)
    if row < B * NH * T:
        t = row % T
        h = row // T % NH
        b = row // (T * NH)
        # the row's maximum, for numerical stability
        maxval = load(preatt, (b, h, t, 0))
        for t2 in range(1, t + 1):
            maxval = max(maxval, load(preatt, (b, h, t, t2)))
        # exponentiate and sum
        expsum = 0.0
        for t2 in range(t + 1):
            e = math.exp(load(preatt, (b, h, t, t2)) - maxval)
            expsum += e
            store(att, (b, h, t, t2), e)
        # normalize (in bf16: the stored, rounded exponentials); 0 above the diagonal
        inv = 1.0 / expsum
        for t2 in range(t + 1):
            store(att, (b, h, t, t2), load(att, (b, h, t, t2)) * inv)
        for t2 in range(t + 1, T):
            store(att, (b, h, t, t2), 0.0)


@cuda.jit
def attention_values_kernel(out, att, inp):
    # out (B,T,C); att (B,NH,T,T); inp (B,T,3C), v = inp[..., 2C:].
    # out[b,t,c] = sum over t2 <= t of att[b,h,t,t2] v[b,t2,c], h = c // hs. Overwrites out. One thread per (b,t,c).
    B, T, C = out.shape
    hs = C // att.shape[1]
    idx = cuda.grid(1)
    if idx < B * T * C:
        c = idx % C
        t = idx // C % T
        b = idx // (C * T)
        h = c // hs
        acc = 0.0
        for t2 in range(t + 1):
            acc += load(att, (b, h, t, t2)) * load(inp, (b, t2, 2 * C + c))
        store(out, (b, t, c), acc)


@cuda.jit
def attention_softmax_backward_kernel(dpreatt, datt, att):
    # dpreatt, datt, att (B,NH,T,T). dpreatt = att * (datt - sum over t2 <= t of att datt), 0 above the diagonal.
    # Overwrites dpreatt. One thread per row (b,h,t).
    B, NH, T, _ = att.shape
    row = cuda.grid(1)
    if row < B * NH * T:
        t = row % T
        h = row // T % NH
        b = row // (T * NH)
        # sum over the row of att * datt
        s = 0.0
        for t2 in range(t + 1):
            s += load(att, (b, h, t, t2)) * load(datt, (b, h, t, t2))
        # local softmax derivative; 0 above the diagonal
        for t2 in range(t + 1):
            store(dpreatt, (b, h, t, t2), load(att, (b, h, t, t2)) * (load(datt, (b, h, t, t2)) - s))
        for t2 in range(t + 1, T):
            store(dpreatt, (b, h, t, t2), 0.0)


@cuda.jit
def attention_dinp_kernel(dinp, dpreatt, att, dout, inp, scale):
    # dinp, inp (B,T,3C); dpreatt, att (B,NH,T,T); dout (B,T,C). Accumulates (+=) into dinp.
    # Thread (b,t,c), c in head h, owns dq, dk and dv at (b,t,c), each summed in a fixed order:
    #   dq[t] += scale * sum over t2 <= t of dpreatt[t,t2] k[t2]
    #   dk[t] += scale * sum over t3 >= t of dpreatt[t3,t] q[t3]
    #   dv[t] +=         sum over t3 >= t of att[t3,t] dout[t3]
    B, T, C = dout.shape
    hs = C // att.shape[1]
    idx = cuda.grid(1)
    if idx < B * T * C:
        c = idx % C
        t = idx // C % T
        b = idx // (C * T)
        h = c // hs
        # position t as a query: the keys it looked at
        dq = 0.0
        for t2 in range(t + 1):
            dq += load(dpreatt, (b, h, t, t2)) * load(inp, (b, t2, C + c))
        # position t as a key and a value: the queries that looked at it
        dk = 0.0
        dv = 0.0
        for t3 in range(t, T):
            dk += load(dpreatt, (b, h, t3, t)) * load(inp, (b, t3, c))
            dv += load(att, (b, h, t3, t)) * load(dout, (b, t3, c))
        store_add(dinp, (b, t, c), scale * dq)
        store_add(dinp, (b, t, C + c), scale * dk)
        store_add(dinp, (b, t, 2 * C + c), dv)


# ---- the gemm path's kernels: head-major copies and a softmax per row --------------------------------
@cuda.jit
def heads_split_kernel(y, x):
    # x (B*T, S*C), y (S,B,NH,T,hs): y[s,b,h,t,i] = x[b*T+t, s*C + h*hs + i]. Overwrites y. S=3: q, k, v out of
    # the qkv activation; S=1: dout. Block (row, j) and its threads: columns j*blockDim + tid of one row of x
    # (reads in order; writes in runs of hs).
    NH, T, hs = y.shape[2:]
    row = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if c < x.shape[1]:
        b = row // T
        t = row - b * T
        head = c // hs                      # s * NH + h
        store(y, (head // NH, b, head % NH, t, c - head * hs), load(x, (row, c)))


@cuda.jit
def heads_merge_kernel(x, y, accumulate):
    # the inverse: x[b*T+t, s*C + h*hs + i] (+)= y[s,b,h,t,i]. Same grid: one row of x per block row.
    NH, T, hs = y.shape[2:]
    row = cuda.blockIdx.x
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if c < x.shape[1]:
        b = row // T
        t = row - b * T
        head = c // hs
        v = load(y, (head // NH, b, head % NH, t, c - head * hs))
        if accumulate:
            store_add(x, (row, c), v)
        else:
            store(x, (row, c), v)


@cuda.jit
def softmax_rows_kernel(att, preatt):
    # att, preatt (R,T,T), R = B*NH. att[r,t,:] = softmax of preatt[r,t,:t+1], 0 above the diagonal.
    # One block per row (r,t); its threads stride over t2 and meet in shared-memory reductions. Overwrites att.
    T = att.shape[1]
    row = cuda.blockIdx.x
    r = row // T
    t = row % T
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # the row's maximum over t2 <= t
    m = -math.inf
    for t2 in range(tid, t + 1, nt):
        m = max(m, numba.float64(load(preatt, (r, t, t2))))
    buf[tid] = m
    cuda.syncthreads()
    block_max(buf, tid, nt)
    maxval = numba.float32(buf[0])
    cuda.syncthreads()                  # everyone has read the max before buf is reused
    # the sum of exp(x - max): float32 exponentials (the fast expf), summed in float64
    s = 0.0
    for t2 in range(tid, t + 1, nt):
        s += math.exp(numba.float32(load(preatt, (r, t, t2)) - maxval))
    buf[tid] = s
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    inv = numba.float32(1.0 / buf[0])
    # normalise; 0 above the diagonal
    for t2 in range(tid, T, nt):
        store(att, (r, t, t2), math.exp(numba.float32(load(preatt, (r, t, t2)) - maxval)) * inv if t2 <= t else 0.0)


@cuda.jit
def softmax_rows_backward_kernel(dpreatt, datt, att):
    # dpreatt, datt, att (R,T,T). dpreatt = att * (datt - sum over t2 <= t of att datt), 0 above the diagonal.
    # One block per row. Overwrites dpreatt.
    T = att.shape[1]
    row = cuda.blockIdx.x
    r = row // T
    t = row % T
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    s = 0.0
    for t2 in range(tid, t + 1, nt):
        s += load(att, (r, t, t2)) * load(datt, (r, t, t2))
    buf[tid] = s
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    total = numba.float32(buf[0])           # the rest in float32 arithmetic
    for t2 in range(tid, T, nt):
        store(dpreatt, (r, t, t2), load(att, (r, t, t2)) * (load(datt, (r, t, t2)) - total) if t2 <= t else 0.0)


# The same two row operations on a GPU, one warp (32 lanes) per row and 8 rows per block: lane j takes
# t2 = j, j+32, ..., and the lanes combine through warp shuffles (no shared memory, no __syncthreads). The
# combination runs in a fixed order (lane 0 gathers by shfl_down, then broadcasts), so the bits are the
# same every run. The simulator has no shuffles: it runs the block kernels above.
# Each lane reads UNROLL elements of its row (t2, t2+32, t2+64, t2+96) before it computes with any of them:
# a row is only 1024 elements, one 2-byte load per lane per iteration would keep ~64 bytes in flight per
# warp, far too few to cover the H200's memory latency (measured: the one-at-a-time loop ran bf16 at ~1 TB/s).
FULL_MASK = 0xFFFFFFFF
ROWS_PER_BLOCK = 8
UNROLL = 4
CHUNK = 32 * UNROLL                     # elements (pairs: words) of a row a warp reads per iteration


@cuda.jit(device=True)
def _combine(m, s, mo, so):
    # two partial softmax sums (max m, sum of exp(x - m)) -> one, against the larger max; an empty part
    # has m = -inf and s = 0 and contributes nothing
    mn = max(m, mo)
    if mn == -math.inf:
        return mn, numba.float32(0.0)
    a = s * math.exp(m - mn) if m != -math.inf else numba.float32(0.0)
    b = so * math.exp(mo - mn) if mo != -math.inf else numba.float32(0.0)
    return mn, a + b


@cuda.jit(device=True)
def _warp_max_inv_sum(m, s):
    """Every lane's partial (max, sum of exp(x - max)) -> the row's (max, 1 / sum), in every lane. The lanes
    combine halving each time (shfl_down: a fixed order); lane 0 ends with the row's and hands it to all."""
    off = 16
    while off > 0:
        mo = cuda.shfl_down_sync(FULL_MASK, m, off)
        so = cuda.shfl_down_sync(FULL_MASK, s, off)
        m, s = _combine(m, s, mo, so)
        off //= 2
    return cuda.shfl_sync(FULL_MASK, m, 0), numba.float32(1.0) / cuda.shfl_sync(FULL_MASK, s, 0)


@cuda.jit(device=True)
def _warp_total(s):
    """The sum of every lane's s, in the same fixed order as _warp_max_inv_sum, in every lane."""
    off = 16
    while off > 0:
        s += cuda.shfl_down_sync(FULL_MASK, s, off)
        off //= 2
    return cuda.shfl_sync(FULL_MASK, s, 0)


@cuda.jit(device=True)
def _at(a, r, t, t2, last, fill):
    """a[r, t, t2] as a float32 for t2 <= last, else `fill` (past the diagonal or the row's end)."""
    return numba.float32(load(a, (r, t, t2))) if t2 <= last else fill


@cuda.jit(device=True)
def _warp_row():
    """(row, lane) of this thread: ROWS_PER_BLOCK warps per block, one row each."""
    return cuda.blockIdx.x * ROWS_PER_BLOCK + cuda.threadIdx.x // 32, cuda.threadIdx.x % 32


@cuda.jit
def softmax_rows_warp_kernel(att, preatt):
    # att, preatt (R,T,T): as softmax_rows_kernel, one warp per row (r,t). Overwrites att.
    T = att.shape[1]
    row, lane = _warp_row()
    if row >= att.shape[0] * T:
        return                              # the whole warp leaves together
    r = row // T
    t = row - r * T
    ninf = numba.float32(-math.inf)
    # one pass: this lane's running max and sum of exp(x - max) (online softmax), float32; positions past
    # the diagonal read as -inf and add exp(-inf) = 0
    m = ninf
    s = numba.float32(0.0)
    for base in range(lane, t + 1, CHUNK):
        x0 = _at(preatt, r, t, base, t, ninf)
        x1 = _at(preatt, r, t, base + 32, t, ninf)
        x2 = _at(preatt, r, t, base + 64, t, ninf)
        x3 = _at(preatt, r, t, base + 96, t, ninf)
        mx = max(max(x0, x1), max(x2, x3))      # x0 is on or below the diagonal: mx is finite
        if mx > m:
            s *= math.exp(m - mx)               # rescale the sum so far to the new max (m = -inf: s = 0)
            m = mx
        s += (math.exp(x0 - m) + math.exp(x1 - m)) + (math.exp(x2 - m) + math.exp(x3 - m))
    # the row's max and 1 / sum, in every lane
    m, inv = _warp_max_inv_sum(m, s)
    # normalise (the row's loads first, then the stores); 0 above the diagonal
    for base in range(lane, T, CHUNK):
        x0 = _at(preatt, r, t, base, t, ninf)
        x1 = _at(preatt, r, t, base + 32, t, ninf)
        x2 = _at(preatt, r, t, base + 64, t, ninf)
        x3 = _at(preatt, r, t, base + 96, t, ninf)
        store(att, (r, t, base), math.exp(x0 - m) * inv)          # exp(-inf) = 0 above the diagonal
        if base + 32 < T:
            store(att, (r, t, base + 32), math.exp(x1 - m) * inv)
        if base + 64 < T:
            store(att, (r, t, base + 64), math.exp(x2 - m) * inv)
        if base + 96 < T:
            store(att, (r, t, base + 96), math.exp(x3 - m) * inv)


@cuda.jit
def softmax_rows_backward_warp_kernel(dpreatt, datt, att):
    # as softmax_rows_backward_kernel, one warp per row. Overwrites dpreatt.
    T = att.shape[1]
    row, lane = _warp_row()
    if row >= att.shape[0] * T:
        return
    r = row // T
    t = row - r * T
    zero = numba.float32(0.0)
    # sum over t2 <= t of att * datt (past the diagonal: 0 * 0)
    s = zero
    for base in range(lane, t + 1, CHUNK):
        a0 = _at(att, r, t, base, t, zero)
        a1 = _at(att, r, t, base + 32, t, zero)
        a2 = _at(att, r, t, base + 64, t, zero)
        a3 = _at(att, r, t, base + 96, t, zero)
        d0 = _at(datt, r, t, base, t, zero)
        d1 = _at(datt, r, t, base + 32, t, zero)
        d2 = _at(datt, r, t, base + 64, t, zero)
        d3 = _at(datt, r, t, base + 96, t, zero)
        s += (a0 * d0 + a1 * d1) + (a2 * d2 + a3 * d3)
    total = _warp_total(s)
    # dpreatt = att * (datt - total) on and below the diagonal (the loads first), 0 above (not -0.0)
    for base in range(lane, T, CHUNK):
        a0 = _at(att, r, t, base, t, zero)
        a1 = _at(att, r, t, base + 32, t, zero)
        a2 = _at(att, r, t, base + 64, t, zero)
        a3 = _at(att, r, t, base + 96, t, zero)
        d0 = _at(datt, r, t, base, t, zero)
        d1 = _at(datt, r, t, base + 32, t, zero)
        d2 = _at(datt, r, t, base + 64, t, zero)
        d3 = _at(datt, r, t, base + 96, t, zero)
        store(dpreatt, (r, t, base), a0 * (d0 - total) if base <= t else zero)
        if base + 32 < T:
            store(dpreatt, (r, t, base + 32), a1 * (d1 - total) if base + 32 <= t else zero)
        if base + 64 < T:
            store(dpreatt, (r, t, base + 64), a2 * (d2 - total) if base + 64 <= t else zero)
        if base + 96 < T:
            store(dpreatt, (r, t, base + 96), a3 * (d3 - total) if base + 96 <= t else zero)


# The same kernels reading and writing two elements per load and store (llmz.kernels.bf16's paired
# accessors): rows of bf16 as uint32 words, of float32 as uint64 words, word w = elements 2w and 2w+1. T
# must be even. A lane takes words w, w+32, w+64, w+96 per iteration (8 elements); bf16 kernels otherwise
# run at the rate of 2-byte load instructions, not at the memory's.
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


@cuda.jit
def softmax_rows_pairs_kernel(att, preatt, write_upper):
    # att, preatt: (R,T,T/2) paired views of (R,T,T) rows. As softmax_rows_warp_kernel, one warp per row.
    # Overwrites att on and below the diagonal; above it writes +0.0 if write_upper, else leaves it (the
    # caller's att already holds the zeros: a quarter of the kernel's bytes not moved).
    T = att.shape[1]
    W = att.shape[2]
    row, lane = _warp_row()
    if row >= att.shape[0] * T:
        return
    r = row // T
    t = row - r * T
    ninf = numba.float32(-math.inf)
    zero = numba.float32(0.0)
    # online max and sum over t2 <= t: words w <= t // 2, eight elements per lane per iteration
    m = ninf
    s = zero
    for w in range(lane, t // 2 + 1, CHUNK):
        x0, x1 = _pair_at(preatt, r, t, w, t, ninf)
        x2, x3 = _pair_at(preatt, r, t, w + 32, t, ninf)
        x4, x5 = _pair_at(preatt, r, t, w + 64, t, ninf)
        x6, x7 = _pair_at(preatt, r, t, w + 96, t, ninf)
        mx = max(max(max(x0, x1), max(x2, x3)), max(max(x4, x5), max(x6, x7)))     # x0 <= t: finite
        if mx > m:
            s *= math.exp(m - mx)
            m = mx
        s += ((math.exp(x0 - m) + math.exp(x1 - m)) + (math.exp(x2 - m) + math.exp(x3 - m))) + \
             ((math.exp(x4 - m) + math.exp(x5 - m)) + (math.exp(x6 - m) + math.exp(x7 - m)))
    m, inv = _warp_max_inv_sum(m, s)
    # normalise: the loads of the iteration first, then its stores; 0 above the diagonal (the words up to
    # the diagonal's only, unless write_upper)
    end = W if write_upper else t // 2 + 1
    for w in range(lane, end, CHUNK):
        x0, x1 = _pair_at(preatt, r, t, w, t, ninf)
        x2, x3 = _pair_at(preatt, r, t, w + 32, t, ninf)
        x4, x5 = _pair_at(preatt, r, t, w + 64, t, ninf)
        x6, x7 = _pair_at(preatt, r, t, w + 96, t, ninf)
        _tril_pair(att, r, t, w, math.exp(x0 - m) * inv, math.exp(x1 - m) * inv, zero)
        if w + 32 < end:
            _tril_pair(att, r, t, w + 32, math.exp(x2 - m) * inv, math.exp(x3 - m) * inv, zero)
        if w + 64 < end:
            _tril_pair(att, r, t, w + 64, math.exp(x4 - m) * inv, math.exp(x5 - m) * inv, zero)
        if w + 96 < end:
            _tril_pair(att, r, t, w + 96, math.exp(x6 - m) * inv, math.exp(x7 - m) * inv, zero)


@cuda.jit
def softmax_rows_backward_pairs_kernel(dpreatt, datt, att, write_upper):
    # paired views (R,T,T/2). As softmax_rows_backward_warp_kernel. Overwrites dpreatt on and below the
    # diagonal; above it as softmax_rows_pairs_kernel does att.
    T = att.shape[1]
    W = att.shape[2]
    row, lane = _warp_row()
    if row >= att.shape[0] * T:
        return
    r = row // T
    t = row - r * T
    zero = numba.float32(0.0)
    # sum over t2 <= t of att * datt
    s = zero
    for w in range(lane, t // 2 + 1, CHUNK):
        a0, a1 = _pair_at(att, r, t, w, t, zero)
        a2, a3 = _pair_at(att, r, t, w + 32, t, zero)
        a4, a5 = _pair_at(att, r, t, w + 64, t, zero)
        a6, a7 = _pair_at(att, r, t, w + 96, t, zero)
        d0, d1 = _pair_at(datt, r, t, w, t, zero)
        d2, d3 = _pair_at(datt, r, t, w + 32, t, zero)
        d4, d5 = _pair_at(datt, r, t, w + 64, t, zero)
        d6, d7 = _pair_at(datt, r, t, w + 96, t, zero)
        s += ((a0 * d0 + a1 * d1) + (a2 * d2 + a3 * d3)) + ((a4 * d4 + a5 * d5) + (a6 * d6 + a7 * d7))
    total = _warp_total(s)
    # dpreatt = att * (datt - total) on and below the diagonal, 0 above (up to the diagonal's word only,
    # unless write_upper)
    end = W if write_upper else t // 2 + 1
    for w in range(lane, end, CHUNK):
        a0, a1 = _pair_at(att, r, t, w, t, zero)
        a2, a3 = _pair_at(att, r, t, w + 32, t, zero)
        a4, a5 = _pair_at(att, r, t, w + 64, t, zero)
        a6, a7 = _pair_at(att, r, t, w + 96, t, zero)
        d0, d1 = _pair_at(datt, r, t, w, t, zero)
        d2, d3 = _pair_at(datt, r, t, w + 32, t, zero)
        d4, d5 = _pair_at(datt, r, t, w + 64, t, zero)
        d6, d7 = _pair_at(datt, r, t, w + 96, t, zero)
        _tril_pair(dpreatt, r, t, w, a0 * (d0 - total), a1 * (d1 - total), zero)
        if w + 32 < end:
            _tril_pair(dpreatt, r, t, w + 32, a2 * (d2 - total), a3 * (d3 - total), zero)
        if w + 64 < end:
            _tril_pair(dpreatt, r, t, w + 64, a4 * (d4 - total), a5 * (d5 - total), zero)
        if w + 96 < end:
            _tril_pair(dpreatt, r, t, w + 96, a6 * (d6 - total), a7 * (d7 - total), zero)


# The paired forward again with the row held in registers (T <= 2 * 32 * WORDS_PER_LANE = 1024: d12's T):
# lane l loads words l, l+32, ..., l+480 of the row, the ones on or below the diagonal, every load issued
# before any arithmetic. The loop kernel above waits for memory once per iteration of 128 words and reads
# the row twice (max and sum, then the write); this one waits once per row and reads it once. Each lane
# combines its own values first (its max, then its sum against that max), then the lanes as above.
# (bf16 d12 B=16 T=1024 on the H200, 12 calls a step: loop kernel 6.17 ms, this one 5.58 ms, both also
# leaving the upper triangle unwritten. The same for the backward, att and datt in registers, took 106
# registers a thread and ran slower than its loop kernel, 11.32 against 7.84 ms: not kept.)
WORDS_PER_LANE = 16
VALUES_PER_LANE = 2 * WORDS_PER_LANE       # the elements of those words


@cuda.jit
def softmax_rows_pairs_regs_kernel(att, preatt, write_upper):
    # att, preatt: (R,T,T/2) paired views, T <= 64 * WORDS_PER_LANE. As softmax_rows_pairs_kernel.
    T = att.shape[1]
    W = att.shape[2]
    row, lane = _warp_row()
    if row >= att.shape[0] * T:
        return
    r = row // T
    t = row - r * T
    ninf = numba.float32(-math.inf)
    zero = numba.float32(0.0)
    # the row on and below the diagonal, all loads in flight at once (-inf past it)
    x = cuda.local.array(VALUES_PER_LANE, numba.float32)
    for k in range(WORDS_PER_LANE):
        x[2 * k], x[2 * k + 1] = _pair_at(preatt, r, t, lane + 32 * k, t, ninf)
    loads_barrier()
    # this lane's max, and its sum of exp(x - max) (a lane with no element: max -inf, sum 0)
    m = ninf
    for k in range(VALUES_PER_LANE):
        m = max(m, x[k])
    base = m if m != ninf else zero
    s = zero
    for k in range(VALUES_PER_LANE):
        s += math.exp(x[k] - base)
    # the row's max and 1 / sum, in every lane
    m, inv = _warp_max_inv_sum(m, s)
    # att = exp(x - max) / sum on and below the diagonal, 0 above (up to the diagonal's word, or all W)
    end = W if write_upper else t // 2 + 1
    for k in range(WORDS_PER_LANE):
        w = lane + 32 * k
        if w < end:
            _tril_pair(att, r, t, w, math.exp(x[2 * k] - m) * inv, math.exp(x[2 * k + 1] - m) * inv, zero)


def _pairs_ok(*xs) -> bool:
    """The paired kernels apply: float32 or bf16 rows of even length (the views need it)."""
    return all(x.dtype in (np.float32, np.uint16) and x.shape[-1] % 2 == 0 for x in xs)


def softmax_rows(dev, att3, pre3, upper_is_zero: bool = False) -> None:
    """att3 = causal softmax of each row of pre3, both (R,T,T). upper_is_zero: att3 already holds +0.0 above
    the diagonal (a buffer zeroed once that only this function writes); the paired kernel then leaves it."""
    R, T, _ = att3.shape
    if dev.kind == "gpu" and _pairs_ok(att3, pre3):
        kernel = softmax_rows_pairs_regs_kernel if T <= 64 * WORDS_PER_LANE else softmax_rows_pairs_kernel
        dev.launch(kernel, ceil_div(R * T, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK,
                   pair_view(att3), pair_view(pre3), not upper_is_zero)
    elif dev.kind == "gpu":
        dev.launch(softmax_rows_warp_kernel, ceil_div(R * T, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, att3, pre3)
    else:
        dev.launch(softmax_rows_kernel, R * T, min(dev.block_size, MAX_BLOCK), att3, pre3)


def softmax_rows_backward(dev, dpre3, datt3, att3, upper_is_zero: bool = False) -> None:
    """dpre3 = softmax backward of datt3 given att3, all (R,T,T); upper_is_zero for dpre3 as in softmax_rows."""
    R, T, _ = att3.shape
    if dev.kind == "gpu" and _pairs_ok(dpre3, datt3, att3):
        dev.launch(softmax_rows_backward_pairs_kernel, ceil_div(R * T, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK,
                   pair_view(dpre3), pair_view(datt3), pair_view(att3), not upper_is_zero)
    elif dev.kind == "gpu":
        dev.launch(softmax_rows_backward_warp_kernel, ceil_div(R * T, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK,
                   dpre3, datt3, att3)
    else:
        dev.launch(softmax_rows_backward_kernel, R * T, min(dev.block_size, MAX_BLOCK), dpre3, datt3, att3)


def _heads(dev, kernel, x, y, *args) -> None:
    """kernel over x (B,T,S*C) viewed as rows, and y (S,B,NH,T,hs)."""
    x2 = x.reshape(-1, x.shape[-1])
    grid = (x2.shape[0], ceil_div(x2.shape[1], dev.block_size))
    dev.launch(kernel, grid, dev.block_size, *((x2, y) if kernel is heads_merge_kernel else (y, x2)), *args)


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


# The cuBLAS products over the causal T x T square skip its blocks above the diagonal: the rows go in
# CAUSAL_BLOCKS blocks, and the block of rows [t0, t1) meets only keys [0, t1) (the later keys have att = 0,
# dpreatt = 0). With 2 blocks the products cover 3/4 of the square, with 4 blocks 10/16, in 2 or 4 calls each
# instead of one. bf16 d12 B=16 T=1024 on the H200: full squares, the six products 9.36 ms/step at ~200
# TFLOP/s (bound by the T x T reads and writes); 4 blocks 8.67 ms (the smaller products run at 80-160
# TFLOP/s). Whole graphed steps, the same build: 1 block 55.76 ms, 2 blocks 54.86, 4 blocks 55.15.
CAUSAL_BLOCKS = 2


def _causal_blocks(T: int) -> list:
    """(t0, t1) of the row blocks of a causal T x T product."""
    n = min(CAUSAL_BLOCKS, T)
    edges = [T * i // n for i in range(n + 1)]
    return list(itertools.pairwise(edges))


def attention_forward_heads(dev, out, preatt, att, inp, num_heads, upper_is_zero=False) -> None:
    """The gemm path on cuBLAS: every product reads its head straight out of inp and writes into out
    (gemmBatchedEx over per-head addresses, llmz.kernels.gemm.Heads). Overwrites out, att, and preatt on
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


def attention_forward_gemm(dev, out, preatt, att, inp, num_heads, qkvr) -> None:
    """The gemm path of attention_forward with head-major copies (the tiled product needs contiguous
    batches): qkvr (3,B,NH,T,hs) receives q, k, v (kept for backward). Overwrites out, att, qkvr and preatt
    on and below the diagonal."""
    B, T, C3 = inp.shape
    C = C3 // 3
    R, hs = B * num_heads, C // num_heads
    q, k, v = (x.reshape(R, T, hs) for x in qkvr)
    pre3, att3 = preatt.reshape(R, T, T), att.reshape(R, T, T)
    # q, k, v head-major
    _heads(dev, heads_split_kernel, inp, qkvr)
    # preatt = q @ k.T / sqrt(hs), B*NH products of (T,hs) x (hs,T)
    gemm(dev, pre3, q, k, False, True, False, alpha=1.0 / math.sqrt(hs))
    # att = causal softmax of each row
    softmax_rows(dev, att3, pre3)
    # y = att @ v, head-major, then the heads back side by side into out
    y = dev.scratch("attention_y", (1, B, num_heads, T, hs))
    gemm(dev, y.reshape(R, T, hs), att3, v, False, False, False)
    _heads(dev, heads_merge_kernel, out, y, False)


def attention_backward_gemm(dev, dinp, dpreatt, datt, dout, att, num_heads, qkvr) -> None:
    """The gemm path of attention_backward, from forward's qkvr. Accumulates (+=) into dinp; overwrites
    dpreatt, datt (scratch)."""
    B, T, C = dout.shape
    R, hs = B * num_heads, C // num_heads
    q, k, v = (x.reshape(R, T, hs) for x in qkvr)
    att3, datt3, dpre3 = att.reshape(R, T, T), datt.reshape(R, T, T), dpreatt.reshape(R, T, T)
    dy = dev.scratch("attention_y", (1, B, num_heads, T, hs))
    dqkvr = dev.scratch("attention_dqkv", (3, B, num_heads, T, hs))
    dq, dk, dv = (x.reshape(R, T, hs) for x in dqkvr)
    dy3 = dy.reshape(R, T, hs)
    # dout head-major
    _heads(dev, heads_split_kernel, dout, dy)
    # through y = att @ v: datt = dy @ v.T, dv = att.T @ dy
    gemm(dev, datt3, dy3, v, False, True, False)
    gemm(dev, dv, att3, dy3, True, False, False)
    # softmax backward, row by row
    softmax_rows_backward(dev, dpre3, datt3, att3)
    # through preatt = q @ k.T * scale: dq = dpreatt @ k * scale, dk = dpreatt.T @ q * scale
    scale = 1.0 / math.sqrt(hs)
    gemm(dev, dq, dpre3, k, False, False, False, alpha=scale)
    gemm(dev, dk, dpre3, q, True, False, False, alpha=scale)
    # dq | dk | dv back into the (B,T,3C) layout, added to dinp
    _heads(dev, heads_merge_kernel, dinp, dqkvr, True)


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def attention_forward(dev, out, preatt, att, inp, num_heads, qkvr=None, upper_is_zero=False) -> None:
    """inp (B,T,3C) -> out (B,T,C); preatt, att (B,NH,T,T) kept for backward. Overwrites all three.
    With dev.attention == 'gemm' pass qkvr (3,B,NH,T,hs), which backward needs too. upper_is_zero: att
    already holds +0.0 above the diagonal (zeroed once, written only here); a kernel may leave it."""
    if not dev.kernels:
        return attention_forward_ref(out, preatt, att, inp, num_heads)
    if dev.attention == "gemm" and dev.matmul == "cublas":
        return attention_forward_heads(dev, out, preatt, att, inp, num_heads, upper_is_zero)
    if dev.attention == "gemm":
        return attention_forward_gemm(dev, out, preatt, att, inp, num_heads, qkvr)
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // num_heads
    bs = dev.block_size
    # preatt = q . k / sqrt(hs)
    dev.launch(attention_scores_kernel, ceil_div(B * num_heads * T * T, bs), bs,
               preatt, inp, 0, inp, C, hs, 1.0 / math.sqrt(hs))
    # att = causal softmax of preatt
    dev.launch(attention_softmax_kernel, ceil_div(B * num_heads * T, bs), bs, att, preatt)
    # out = att @ v
    dev.launch(attention_values_kernel, ceil_div(B * T * C, bs), bs, out, att, inp)


def attention_backward(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, qkvr=None, accumulate=True,
                       upper_is_zero=False) -> None:
    """dout (B,T,C) -> dinp (B,T,3C): accumulates (+=; accumulate=False: overwrites). dpreatt, datt
    (B,NH,T,T): scratch, overwritten (upper_is_zero for dpreatt as attention_forward's for att). The gemm
    path reads forward's qkvr instead of inp."""
    if not dev.kernels:
        return attention_backward_ref(dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate)
    if dev.attention == "gemm" and dev.matmul == "cublas":
        return attention_backward_heads(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate,
                                        upper_is_zero)
    if not accumulate:
        zero(dev, dinp)                 # the kernels below accumulate
    if dev.attention == "gemm":
        return attention_backward_gemm(dev, dinp, dpreatt, datt, dout, att, num_heads, qkvr)
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // num_heads
    bs = dev.block_size
    # datt = dout . v
    dev.launch(attention_scores_kernel, ceil_div(B * num_heads * T * T, bs), bs,
               datt, dout, 0, inp, 2 * C, hs, 1.0)
    # dpreatt = softmax backward of datt
    dev.launch(attention_softmax_backward_kernel, ceil_div(B * num_heads * T, bs), bs, dpreatt, datt, att)
    # dq, dk, dv
    dev.launch(attention_dinp_kernel, ceil_div(B * T * C, bs), bs,
               dinp, dpreatt, att, dout, inp, 1.0 / math.sqrt(hs))
