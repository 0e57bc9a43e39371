"""Causal multi-head self-attention, as llm.c's train_gpt2.c attention_forward / attention_backward:

    inp (B,T,3C) holds q | k | v for every position; head h is channels h*hs:(h+1)*hs of each, hs = C / NH
    preatt[b,h,t,t2] = q[b,t,h] . k[b,t2,h] / sqrt(hs)       for t2 <= t, 0 above the diagonal
    att[b,h,t,:]     = softmax of preatt[b,h,t,:t+1]          (max-subtracted), 0 above the diagonal
    out[b,t,h]       = sum over t2 of att[b,h,t,t2] v[b,t2,h]

Backward (softmax backward: dpreatt = att * (datt - sum_t2 att datt)):
    datt = dout . v,  dv += att^T dout,  dq += dpreatt @ k / sqrt(hs),  dk += dpreatt^T @ q / sqrt(hs)

One kernel per line of the math, each one thread per output element (or per row of att): scores (preatt;
in backward datt), softmax, values; softmax backward, dinp. out, preatt, att (B,NH,T,T) are overwritten;
dinp accumulates (+=) as in llm.c; dpreatt and datt are scratch for this call, overwritten (llm.c's CPU
version accumulates into them). Arrays may be float32, float64 or uint16 (bf16 bits, computed in float32,
results rounded to nearest), each on its own, through llmz.kernels.bf16's load / store / store_add. In bf16
the softmax kernel rounds twice (att holds the unnormalised exponentials before it is scaled in place), the
other kernels once per element.
"""
import math

import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store, store_add
from .fill import zero
from .grid import ceil_div


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
@cuda.jit(device=True)
def row_of(row, NH, T):
    """(b, h, t) of row b*NH*T + h*T + t of att (B,NH,T,T)."""
    return row // (T * NH), row // T % NH, row % T


@cuda.jit(device=True)
def this_channel(x, NH):
    """This thread's element of x (B,T,C), one thread per element: (inside, b, t, c, h), h the head of channel c
    and inside False for the threads past the last element."""
    B, T, C = x.shape
    idx = cuda.grid(1)
    c = idx % C
    return idx < B * T * C, idx // (C * T), idx // C % T, c, c // (C // NH)


@cuda.jit
def attention_scores_kernel(scores, x, x_off, y, y_off, hs, scale):
    # scores (B,NH,T,T); x (B,T,*), y (B,T,*), head h of x being channels x_off + h*hs : x_off + (h+1)*hs (y alike).
    # scores[b,h,t,t2] = scale * x[b,t,h] . y[b,t2,h] for t2 <= t, 0 above the diagonal. Overwrites scores.
    # Forward: preatt from q and k; backward: datt from dout and v. One thread per element of scores.
    B, NH, T, _ = scores.shape
    idx = cuda.grid(1)
    if idx < B * NH * T * T:
        b, h, t = row_of(idx // T, NH, T)
        t2 = idx % T
        if t2 <= t:
            # dot product over the head's channels
            acc = np.float64(0.0)
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
        b, h, t = row_of(row, NH, T)
        # the row's maximum, for numerical stability
        maxval = load(preatt, (b, h, t, 0))
        for t2 in range(1, t + 1):
            maxval = max(maxval, load(preatt, (b, h, t, t2)))
        # exponentiate and sum
        expsum = np.float64(0.0)
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
    C = out.shape[2]
    inside, b, t, c, h = this_channel(out, att.shape[1])
    if inside:
        acc = np.float64(0.0)
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
        b, h, t = row_of(row, NH, T)
        # sum over the row of att * datt
        s = np.float64(0.0)
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
    T, C = dout.shape[1:]
    inside, b, t, c, h = this_channel(dout, att.shape[1])
    if inside:
        # position t as a query: the keys it looked at
        dq = np.float64(0.0)
        for t2 in range(t + 1):
            dq += load(dpreatt, (b, h, t, t2)) * load(inp, (b, t2, C + c))
        # position t as a key and a value: the queries that looked at it
        dk = np.float64(0.0)
        dv = np.float64(0.0)
        for t3 in range(t, T):
            dk += load(dpreatt, (b, h, t3, t)) * load(inp, (b, t3, c))
            dv += load(att, (b, h, t3, t)) * load(dout, (b, t3, c))
        store_add(dinp, (b, t, c), scale * dq)
        store_add(dinp, (b, t, C + c), scale * dk)
        store_add(dinp, (b, t, 2 * C + c), dv)


# ---- the layer: the kernels' launches -----------------------------------------------------------
def attention_forward(dev, out, preatt, att, inp, num_heads, upper_is_zero=False) -> None:
    """inp (B,T,3C) -> out (B,T,C); preatt, att (B,NH,T,T) kept for backward. Overwrites all three.
    upper_is_zero: att already holds +0.0 above the diagonal (the fast set may then leave it); these kernels
    write it anyway."""
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


def attention_backward(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate=True,
                       upper_is_zero=False) -> None:
    """dout (B,T,C) -> dinp (B,T,3C): accumulates (+=; accumulate=False: overwrites). dpreatt, datt
    (B,NH,T,T): scratch, overwritten (upper_is_zero as in attention_forward)."""
    if not accumulate:
        zero(dev, dinp)                 # the dinp kernel accumulates
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
