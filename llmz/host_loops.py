"""The CPU op set's loops: the layers whose NumPy reference spends its time in NumPy's per-call overhead,
written as llm.c's train_gpt2.c writes them, one loop over the rows (Numba's @njit, compiled for the CPU on
first use and cached on disk), with the reference's bits.

At the default run's sizes a row is short (C = 128 channels, T = 64 positions of attention): NumPy then
spends more time starting each row's reduction and each broadcast operation than computing, and every
operation makes a pass over arrays larger than the cache. A loop over the rows does every step of a row while
it is in the cache. llmz.reference calls these for float32 and float64 arrays; the reference functions in
llmz/kernels/ stay the definition, and tests/test_reference.py checks that each loop gives their bits.

How the bits stay the same: each loop does the reference's float operations, in its order and its dtype
(float32 constants for float32 arrays: NumPy turns a Python float into the array's dtype), never fused into
a multiply-add nor reordered (Numba does neither without fastmath; vectorised, each lane still computes one
element's IEEE operations). Two things NumPy does its own way are done its way
here: a sum along a row is NumPy's pairwise summation (`pairwise`: eight running sums, blocks of 128; a sum
down the rows is row after row), and a mean divides that sum by the count in float64. exp and tanh stay
NumPy's (its vectorised versions round differently from the C library's): the caller runs them on the whole
array between two loops.

Shapes: N rows (B*T), C channels, B batch, NH heads, T time.
"""
from __future__ import annotations

import numpy as np
from numba import njit

PW_BLOCKSIZE = 128          # NumPy's pairwise summation: blocks of at most 128 summed with eight running sums
# compiled once and cached beside this file; NumPy's error model: x / 0 is inf or nan as in NumPy (Python's
# would raise, and its check in every division keeps a loop from being vectorised)
loop = njit(cache=True, error_model="numpy")


@loop
def pairwise(a, n):
    """a[0] + ... + a[n-1] (a 1-D contiguous row) in a's dtype, in NumPy's order: under 8 values one after
    another; up to 128 in eight running sums (r_j adds a[j], a[j + 8], ...), combined as
    ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the last n % 8 values one by one; above 128 the
    two halves (the first a multiple of 8) summed so and added."""
    if n < 8:
        res = a.dtype.type(-0.0)
        for i in range(n):
            res += a[i]
        return res
    if n <= PW_BLOCKSIZE:
        r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
        i = 8
        while i < n - n % 8:
            r0 += a[i]
            r1 += a[i + 1]
            r2 += a[i + 2]
            r3 += a[i + 3]
            r4 += a[i + 4]
            r5 += a[i + 5]
            r6 += a[i + 6]
            r7 += a[i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[i]
            i += 1
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return pairwise(a[:n2], n2) + pairwise(a[n2:], n - n2)


@loop
def row_mean(a, n):
    """NumPy's mean of a row: its pairwise sum divided by the count in float64, rounded to a's dtype."""
    return a.dtype.type(np.float64(pairwise(a, n)) / np.float64(n))


# ---- layernorm: llmz.kernels.layernorm's references ----------------------------------------------------------
@loop
def layernorm_forward(out, mean, rstd, inp, weight, bias, eps):
    """out, inp (N, C); mean, rstd (N,); weight, bias (C,); eps in inp's dtype. Overwrites out, mean, rstd."""
    N, C = inp.shape
    xc = np.empty(C, inp.dtype)
    sq = np.empty(C, inp.dtype)
    one = inp.dtype.type(1.0)
    for i in range(N):
        m = row_mean(inp[i], C)
        for c in range(C):
            xc[c] = inp[i, c] - m
            sq[c] = xc[c] * xc[c]
        s = one / np.sqrt(row_mean(sq, C) + eps)
        for c in range(C):
            out[i, c] = xc[c] * s * weight[c] + bias[c]
        mean[i] = m
        rstd[i] = s


@loop
def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """dinp, dout, inp (N, C); weight, dweight, dbias (C,); mean, rstd (N,). Accumulates (+=) into dinp,
    dweight, dbias; the parameter gradients are the sums down the rows, added once."""
    N, C = inp.shape
    norm = np.empty(C, inp.dtype)
    dnorm = np.empty(C, inp.dtype)
    prod = np.empty(C, inp.dtype)
    sum_dout = np.full(C, -0.0, dbias.dtype)      # NumPy's sum down the rows: -0.0, then row after row
    sum_norm_dout = np.full(C, -0.0, dweight.dtype)
    for i in range(N):
        s = rstd[i]
        for c in range(C):
            norm[c] = (inp[i, c] - mean[i]) * s
            dnorm[c] = weight[c] * dout[i, c]
            sum_dout[c] += dout[i, c]
            sum_norm_dout[c] += norm[c] * dout[i, c]
            prod[c] = dnorm[c] * norm[c]
        dnorm_mean = row_mean(dnorm, C)
        dnorm_norm_mean = row_mean(prod, C)
        for c in range(C):
            dinp[i, c] += s * (dnorm[c] - dnorm_mean - norm[c] * dnorm_norm_mean)
    for c in range(C):
        dbias[c] += sum_dout[c]
        dweight[c] += sum_norm_dout[c]


# ---- attention's softmax: llmz.kernels.attention's references, around NumPy's products and exp ---------------
@loop
def causal_logits(preatt, att, scale):
    """preatt, att (B, NH, T, T), preatt holding q.k. Every row t: preatt *= scale, 0 above the diagonal;
    att = preatt, -inf above the diagonal, minus the row's maximum (exp(att) is then the softmax's numerator)."""
    B, NH, T, _ = preatt.shape
    ninf = att.dtype.type(-np.inf)
    zero = att.dtype.type(0.0)
    for b in range(B):
        for h in range(NH):
            for t in range(T):
                row, logits = preatt[b, h, t], att[b, h, t]
                most, nan = ninf, False
                for t2 in range(t + 1):
                    v = row[t2] * scale
                    row[t2] = v
                    logits[t2] = v
                    nan |= v != v
                    most = max(most, v)
                most = most if not nan else att.dtype.type(np.nan)     # NumPy's max: NaN if any is
                for t2 in range(t + 1, T):
                    row[t2] = zero
                    logits[t2] = ninf
                for t2 in range(T):
                    logits[t2] -= most


@loop
def normalize_rows(att):
    """att (B, NH, T, T) holding exp(logits): every row divided by its sum (the whole row, zeros included)."""
    B, NH, T, _ = att.shape
    for b in range(B):
        for h in range(NH):
            for t in range(T):
                row = att[b, h, t]
                total = pairwise(row, T)
                for t2 in range(T):
                    row[t2] /= total


@loop
def softmax_backward(dpreatt, datt, att):
    """dpreatt, datt, att (B, NH, T, T), datt holding dout.v. Every row: datt = 0 above the diagonal, then
    dpreatt = att * (datt - sum over the row of att * datt)."""
    B, NH, T, _ = att.shape
    prod = np.empty(T, att.dtype)
    zero = att.dtype.type(0.0)
    for b in range(B):
        for h in range(NH):
            for t in range(T):
                a, d, out = att[b, h, t], datt[b, h, t], dpreatt[b, h, t]
                for t2 in range(t + 1, T):
                    d[t2] = zero
                for t2 in range(T):
                    prod[t2] = a[t2] * d[t2]
                total = pairwise(prod, T)
                for t2 in range(T):
                    out[t2] = a[t2] * (d[t2] - total)


# ---- GELU: llmz.kernels.gelu's references, around NumPy's tanh ------------------------------------------------
@loop
def gelu_inner(u, x, scale, cubic):
    """u = scale * (x + cubic * (x * x * x)), tanh's argument; u, x flat."""
    for i in range(x.size):
        v = x[i]
        u[i] = scale * (v + cubic * (v * v * v))


@loop
def gelu_outer(out, x, t, half, one):
    """out = half * x * (one + t), t = tanh(u); all flat."""
    for i in range(x.size):
        out[i] = half * x[i] * (one + t[i])


@loop
def gelu_grad_times(dinp, x, t, dout, accumulate, half, one, scale, three_cubic):
    """dinp (+)= (half (one + t) + half x (one - t t) scale (one + three_cubic x x)) * dout; all flat."""
    for i in range(x.size):
        v, th = x[i], t[i]
        local = half * (one + th) + half * v * (one - th * th) * scale * (one + three_cubic * v * v)
        if accumulate:
            dinp[i] += local * dout[i]
        else:
            dinp[i] = local * dout[i]


# ---- AdamW, the bias and the embeddings: llmz.kernels.adamw's, matmul's and encoder's references -----------
@loop
def adamw(params, grads, m, v, decay_size, lr, grad_scale, bc1, bc2, beta1, one_minus_beta1, beta2,
          one_minus_beta2, eps, weight_decay):
    """One AdamW step on flat arrays, every constant in the arrays' dtype; overwrites params, m, v. The first
    decay_size elements add weight_decay * p to their step, the rest nothing (two spans: the loop in each has
    no branch that changes from element to element, so it vectorises)."""
    adamw_span(params, grads, m, v, 0, decay_size, True, lr, grad_scale, bc1, bc2, beta1, one_minus_beta1,
               beta2, one_minus_beta2, eps, weight_decay)
    adamw_span(params, grads, m, v, decay_size, params.size, False, lr, grad_scale, bc1, bc2, beta1,
               one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay)


@loop
def adamw_span(params, grads, m, v, start, end, decays, lr, grad_scale, bc1, bc2, beta1, one_minus_beta1,
               beta2, one_minus_beta2, eps, weight_decay):
    """adamw on elements start .. end - 1; decays: add the weight decay term there."""
    for i in range(start, end):
        g = grads[i] * grad_scale
        m[i] = beta1 * m[i] + one_minus_beta1 * g
        v[i] = beta2 * v[i] + one_minus_beta2 * (g * g)
        step = (m[i] / bc1) / (np.sqrt(v[i] / bc2) + eps)
        if decays:
            step += weight_decay * params[i]
        params[i] -= lr * step


@loop
def add_bias(out, bias):
    """out (N, OC) += bias (OC,) on every row."""
    for i in range(out.shape[0]):
        for c in range(out.shape[1]):
            out[i, c] += bias[c]


@loop
def add_column_sums(dbias, dout):
    """dbias (OC,) += the sum down the rows of dout (N, OC), summed first as NumPy does: -0.0, then row after
    row."""
    total = np.full(dout.shape[1], -0.0, dbias.dtype)
    for i in range(dout.shape[0]):
        for c in range(dout.shape[1]):
            total[c] += dout[i, c]
    for c in range(dout.shape[1]):
        dbias[c] += total[c]


@loop
def add_rows_at(dwte, tokens, dout):
    """dwte[tokens[i]] += dout[i] for i in order (np.add.at's order): dwte (Vp, C), tokens (N,), dout (N, C)."""
    for i in range(tokens.size):
        row = dwte[tokens[i]]
        for c in range(dout.shape[1]):
            row[c] += dout[i, c]
