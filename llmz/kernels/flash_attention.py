"""Causal self-attention as FlashAttention-2 computes it (Dao 2023): the T x T matrix is never stored.

The math is llmz.kernels.attention's (inp (B,T,3C) holds q | k | v, head h at channels h*hs, out (B,T,C),
scores scaled by 1/sqrt(hs), causal); only the order of work changes. Online softmax: a query row meets the
keys a tile at a time, keeping its running max m, running sum l of exp(s - m), and output o (unnormalised):
    s_j = q . k_j * scale for the tile's keys j;  m' = max(m, max_j s_j);  alpha = exp(m - m')
    l  <- l * alpha + sum_j exp(s_j - m')          (what was summed against m, rescaled to m')
    o  <- o * alpha + sum_j exp(s_j - m') v_j
after the last tile out = o / l, and lse = m + log(l) (the row's log-sum-exp) is all backward keeps:
P = exp(s - lse) is the softmax, recomputed from q and k when needed.
Backward (per query row t and key u <= t, D_t = dout_t . out_t, a rowsum done once beforehand):
    P = exp(q_t.k_u*scale - lse_t);  dv_u += P dout_t;  dP = dout_t . v_u;  dS = P (dP - D_t)
    dq_t += dS k_u * scale;          dk_u += dS q_t * scale
Deterministic (no atomics): one kernel owns a key tile and loops over the query tiles after it (dk, dv),
another owns a query tile and loops over the key tiles up to it (dq).

Teaching kernels (run in the simulator and on a GPU; llmz.fast.flash_attention is the tensor-core twin):
one block per (query or key tile, head, batch), one thread per row of the tile, the other operand's tile
staged through shared memory, float64 accumulation. Arrays may be float32, float64 or uint16 (bf16 bits,
through llmz.kernels.bf16's load/store). lse is float32 or float64 (fp32 when the values are bf16).
forward overwrites out and lse; backward accumulates (+=) into dinp (accumulate=False: overwrites).
"""
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store
from .grid import ceil_div

BLOCK = 16              # rows of a tile, queries and keys alike (one thread per row)
HS_MAX = 64             # the head size the shared tiles hold (GPT-2's, at every size from d2 on)
REF_BLOCK = 64          # the NumPy reference's key tile


# ---- NumPy reference ----------------------------------------------------------------------------
def _heads(x, num_heads, parts):
    """x (B,T,parts*C) -> `parts` arrays (B,NH,T,hs), views."""
    B, T, W = x.shape
    y = x.reshape(B, T, parts, num_heads, W // parts // num_heads)
    return [y[:, :, i].transpose(0, 2, 1, 3) for i in range(parts)]


def _merge(x):
    """(B,NH,T,hs) -> (B,T,C)."""
    B, NH, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, NH * hs)


def _scores(q, k, k0, scale):
    """Scaled scores of queries k0.. against the keys k0..k0+len(k) (B,NH,T-k0,bc); -inf where key > query."""
    s = q[:, :, k0:] @ k.swapaxes(-1, -2) * scale
    t = np.arange(k0, k0 + s.shape[2])[:, None]
    u = np.arange(k0, k0 + s.shape[3])[None, :]
    s[..., u > t] = -np.inf
    return s


def flash_attention_forward_ref(out, lse, inp, num_heads):
    """inp (B,T,3C) -> out (B,T,C), lse (B,NH,T). Overwrites out and lse. The online softmax over key tiles
    of REF_BLOCK: the tile of keys [k0, k0+bc) is seen by the queries t >= k0."""
    if is_bf16(out) or is_bf16(inp):
        return run_in_f32(lambda o, x: flash_attention_forward_ref(o, lse, x, num_heads), (out, inp), (0,))
    q, k, v = _heads(inp, num_heads, 3)
    B, NH, T, hs = q.shape
    scale = 1.0 / math.sqrt(hs)
    m = np.full((B, NH, T), -np.inf)        # running max
    l = np.zeros((B, NH, T))                # running sum of exp(s - m)
    o = np.zeros((B, NH, T, hs))            # running sum of exp(s - m) v
    for k0 in range(0, T, REF_BLOCK):
        rows = slice(k0, T)
        s = _scores(q, k[:, :, k0:k0 + REF_BLOCK], k0, scale)
        # the new max; what was summed so far is rescaled to it (key k0 <= t: the max is finite)
        m_new = np.maximum(m[..., rows], s.max(axis=-1))
        alpha = np.exp(m[..., rows] - m_new)
        p = np.exp(s - m_new[..., None])
        l[..., rows] = l[..., rows] * alpha + p.sum(axis=-1)
        o[..., rows, :] = o[..., rows, :] * alpha[..., None] + p @ v[:, :, k0:k0 + REF_BLOCK]
        m[..., rows] = m_new
    out[...] = _merge(o / l[..., None])
    lse[...] = m + np.log(l)


def flash_attention_backward_ref(dinp, dout, inp, out, lse, num_heads, accumulate=True):
    """dout, out (B,T,C); inp, dinp (B,T,3C); lse (B,NH,T) from forward. Accumulates (+=) into dinp
    (accumulate=False: overwrites). P recomputed from q, k and lse, a key tile at a time."""
    arrays = (dinp, dout, inp, out)
    if any(is_bf16(x) for x in arrays):
        return run_in_f32(lambda *xs: flash_attention_backward_ref(*xs, lse, num_heads, accumulate), arrays,
                          (0,))
    q, k, v = _heads(inp, num_heads, 3)
    (do,) = _heads(dout, num_heads, 1)
    T, hs = q.shape[2:]
    scale = 1.0 / math.sqrt(hs)
    dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(q.shape)
    # D = rowsum(dout * out): the softmax backward's sum over the row of P dP
    D = np.sum(do * _heads(out, num_heads, 1)[0], axis=-1)
    for k0 in range(0, T, REF_BLOCK):
        keys, rows = slice(k0, k0 + REF_BLOCK), slice(k0, T)
        # P recomputed from the log-sum-exp (0 above the diagonal)
        p = np.exp(_scores(q, k[:, :, keys], k0, scale) - lse[..., rows, None])
        # through out = P v: dv = P^T dout, dP = dout v^T
        dv[:, :, keys] = p.swapaxes(-1, -2) @ do[:, :, rows]
        dp = do[:, :, rows] @ v[:, :, keys].swapaxes(-1, -2)
        # softmax backward
        ds = p * (dp - D[..., rows, None])
        # through s = q k^T * scale
        dq[:, :, rows] += ds @ k[:, :, keys] * scale
        dk[:, :, keys] = ds.swapaxes(-1, -2) @ q[:, :, rows] * scale
    grads = np.concatenate([_merge(dq), _merge(dk), _merge(dv)], axis=-1)
    if accumulate:
        dinp += grads
    else:
        dinp[...] = grads


# ---- Numba kernels ------------------------------------------------------------------------------
# what the three tile kernels share: where the thread is, a tile staged into shared memory, a row of sums
@cuda.jit(device=True)
def tile_coords(x, lse):
    """(T, C, hs, r, h, b) of this thread: x (B,T,C) and lse (B,NH,T) give the sizes; the grid is (tile, h,
    b) and thread r is row r of its tile."""
    T, C = x.shape[1], x.shape[2]
    return T, C, C // lse.shape[1], cuda.threadIdx.x, cuda.blockIdx.y, cuda.blockIdx.z


@cuda.jit(device=True)
def stage_tile(tile_a, tile_b, a, col_a, b_src, col_b, batch, row, hs, T):
    """Thread r (its threadIdx) copies position `row` of a and b_src (B,T,*), hs channels from col_a and
    col_b, into row r of tile_a and tile_b (BLOCK, HS_MAX); nothing past T."""
    r = cuda.threadIdx.x
    if row < T:
        for i in range(hs):
            tile_a[r, i] = load(a, (batch, row, col_a + i))
            tile_b[r, i] = load(b_src, (batch, row, col_b + i))


@cuda.jit(device=True)
def write_row(dst, batch, row, col, sums, hs, accumulate):
    """dst[batch, row, col + i] (+)= sums[r, i] for i < hs, r the thread's index (accumulate: adds)."""
    r = cuda.threadIdx.x
    for i in range(hs):
        idx = (batch, row, col + i)
        store(dst, idx, sums[r, i] + load(dst, idx) if accumulate else sums[r, i])


@cuda.jit
def flash_attention_forward_kernel(out, lse, inp, scale):
    # out (B,T,C); lse (B,NH,T); inp (B,T,3C). Block (query tile, h, b); thread r owns query t = tile*BLOCK + r.
    # Overwrites out and lse.
    T, C, hs, r, h, b = tile_coords(out, lse)
    t = cuda.blockIdx.x * BLOCK + r
    k_tile = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    v_tile = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    o = cuda.shared.array((BLOCK, HS_MAX), numba.float64)       # row r: this thread's running output
    s = cuda.local.array(BLOCK, numba.float64)
    for i in range(hs):
        o[r, i] = 0.0
    m = -math.inf
    l = 0.0
    # the block's queries see keys [0, end)
    end = min((cuda.blockIdx.x + 1) * BLOCK, T)
    for k0 in range(0, end, BLOCK):
        # stage the key and value tile: thread r copies key k0 + r
        stage_tile(k_tile, v_tile, inp, C + h * hs, inp, 2 * C + h * hs, b, k0 + r, hs, T)
        cuda.syncthreads()
        if t < T:
            # the tile's scores (keys u <= t) and the new running max
            m_new = m
            for j in range(BLOCK):
                if k0 + j <= t:
                    acc = 0.0
                    for i in range(hs):
                        acc += load(inp, (b, t, h * hs + i)) * k_tile[j, i]
                    s[j] = acc * scale
                    m_new = max(m_new, s[j])
            # rescale the sum and the output to the new max, then add this tile's terms
            alpha = math.exp(m - m_new)
            l *= alpha
            for i in range(hs):
                o[r, i] *= alpha
            for j in range(BLOCK):
                if k0 + j <= t:
                    p = math.exp(s[j] - m_new)
                    l += p
                    for i in range(hs):
                        o[r, i] += p * v_tile[j, i]
            m = m_new
        cuda.syncthreads()          # everyone is done with the tile before it is overwritten
    if t < T:
        for i in range(hs):
            store(out, (b, t, h * hs + i), o[r, i] / l)
        store(lse, (b, h, t), m + math.log(l))


@cuda.jit
def flash_attention_rowsum_kernel(dsum, dout, out):
    # dsum (B,NH,T); dout, out (B,T,C). dsum[b,h,t] = dout[b,t,h] . out[b,t,h]. Overwrites dsum.
    # One thread per (b,h,t).
    B, NH, T = dsum.shape
    hs = out.shape[2] // NH
    idx = cuda.grid(1)
    if idx < B * NH * T:
        t = idx % T
        h = idx // T % NH
        b = idx // (T * NH)
        acc = 0.0
        for i in range(h * hs, (h + 1) * hs):
            acc += load(dout, (b, t, i)) * load(out, (b, t, i))
        store(dsum, (b, h, t), acc)


@cuda.jit
def flash_attention_dkv_kernel(dinp, dout, inp, lse, dsum, scale, accumulate):
    # dinp, inp (B,T,3C); dout (B,T,C); lse, dsum (B,NH,T). Block (key tile, h, b); thread r owns key u.
    # dk_u = scale * sum over t >= u of dS[t,u] q_t, dv_u = sum over t >= u of P[t,u] dout_t, the query tiles
    # from the key tile's own (the diagonal) to the last, in order. (+)= into dinp's k and v parts.
    T, C, hs, r, h, b = tile_coords(dout, lse)
    u = cuda.blockIdx.x * BLOCK + r
    dk = cuda.shared.array((BLOCK, HS_MAX), numba.float64)      # row r: this thread's sums, from 0
    dv = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    for i in range(hs):
        dk[r, i] = 0.0
        dv[r, i] = 0.0
    q_tile = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    do_tile = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    for t0 in range(cuda.blockIdx.x * BLOCK, T, BLOCK):
        # stage the query tile: q and dout
        stage_tile(q_tile, do_tile, inp, h * hs, dout, h * hs, b, t0 + r, hs, T)
        cuda.syncthreads()
        if u < T:
            for j in range(BLOCK):
                t = t0 + j
                if u <= t < T:
                    # P recomputed from the log-sum-exp; dP = dout_t . v_u
                    s = 0.0
                    dp = 0.0
                    for i in range(hs):
                        s += q_tile[j, i] * load(inp, (b, u, C + h * hs + i))
                        dp += do_tile[j, i] * load(inp, (b, u, 2 * C + h * hs + i))
                    p = math.exp(s * scale - load(lse, (b, h, t)))
                    ds = p * (dp - load(dsum, (b, h, t)))
                    for i in range(hs):
                        dv[r, i] += p * do_tile[j, i]
                        dk[r, i] += ds * q_tile[j, i] * scale
        cuda.syncthreads()
    if u < T:
        write_row(dinp, b, u, C + h * hs, dk, hs, accumulate)
        write_row(dinp, b, u, 2 * C + h * hs, dv, hs, accumulate)


@cuda.jit
def flash_attention_dq_kernel(dinp, dout, inp, lse, dsum, scale, accumulate):
    # As flash_attention_dkv_kernel for dq: block (query tile, h, b), thread r owns query t;
    # dq_t = scale * sum over u <= t of dS[t,u] k_u, the key tiles from the first to the diagonal, in order.
    T, C, hs, r, h, b = tile_coords(dout, lse)
    t = cuda.blockIdx.x * BLOCK + r
    dq = cuda.shared.array((BLOCK, HS_MAX), numba.float64)      # row r: this thread's sums, from 0
    for i in range(hs):
        dq[r, i] = 0.0
    k_tile = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    v_tile = cuda.shared.array((BLOCK, HS_MAX), numba.float64)
    end = min((cuda.blockIdx.x + 1) * BLOCK, T)
    for k0 in range(0, end, BLOCK):
        stage_tile(k_tile, v_tile, inp, C + h * hs, inp, 2 * C + h * hs, b, k0 + r, hs, T)
        cuda.syncthreads()
        if t < T:
            for j in range(BLOCK):
                if k0 + j <= t:
                    s = 0.0
                    dp = 0.0
                    for i in range(hs):
                        s += load(inp, (b, t, h * hs + i)) * k_tile[j, i]
                        dp += load(dout, (b, t, h * hs + i)) * v_tile[j, i]
                    p = math.exp(s * scale - load(lse, (b, h, t)))
                    ds = p * (dp - load(dsum, (b, h, t)))
                    for i in range(hs):
                        dq[r, i] += ds * k_tile[j, i] * scale
        cuda.syncthreads()
    if t < T:
        write_row(dinp, b, t, h * hs, dq, hs, accumulate)


# ---- the layer: the kernels' launches -----------------------------------------------------------
def _check_head_size(hs: int) -> None:
    if hs > HS_MAX:
        raise ValueError(f"flash attention's teaching kernels hold heads of at most {HS_MAX} channels, "
                         f"got head size {hs}")


def flash_attention_forward(dev, out, lse, inp, num_heads) -> None:
    """inp (B,T,3C) -> out (B,T,C) and lse (B,NH,T), the per-row log-sum-exp kept for backward.
    Overwrites out and lse. (llmz.fast.flash_attention runs bf16 values of head size 64 on tensor cores.)"""
    B, T, C3 = inp.shape
    hs = C3 // 3 // num_heads
    _check_head_size(hs)
    dev.launch(flash_attention_forward_kernel, (ceil_div(T, BLOCK), num_heads, B), BLOCK,
               out, lse, inp, 1.0 / math.sqrt(hs))


def flash_attention_backward(dev, dinp, dout, inp, out, lse, num_heads, accumulate=True) -> None:
    """dout (B,T,C) -> dinp (B,T,3C): accumulates (+=; accumulate=False: overwrites). Reads forward's inp,
    out and lse. D = rowsum(dout * out) goes through a (B,NH,T) scratch buffer of lse's dtype."""
    B, T, C3 = inp.shape
    hs = C3 // 3 // num_heads
    dsum = dev.scratch("flash_attention_dsum", lse.shape, lse.dtype)
    _check_head_size(hs)
    scale = 1.0 / math.sqrt(hs)
    # D = rowsum(dout * out)
    dev.launch(flash_attention_rowsum_kernel, ceil_div(B * num_heads * T, dev.block_size), dev.block_size,
               dsum, dout, out)
    grid = (ceil_div(T, BLOCK), num_heads, B)
    # dk, dv: a block per key tile; dq: a block per query tile
    dev.launch(flash_attention_dkv_kernel, grid, BLOCK, dinp, dout, inp, lse, dsum, scale, accumulate)
    dev.launch(flash_attention_dq_kernel, grid, BLOCK, dinp, dout, inp, lse, dsum, scale, accumulate)


def lse_dtype(dtype) -> np.dtype:
    """lse's dtype for values of `dtype`: float32 for bf16 (uint16) and float32, float64 for float64."""
    return np.dtype(np.float32 if np.dtype(dtype) == np.uint16 else dtype)
