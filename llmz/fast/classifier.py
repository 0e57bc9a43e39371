"""The classifier's fast kernels (llm.c's fused_classifier). The math, shapes and dtypes are
llmz/kernels/classifier.py's; the model's two calls are fused here:

  classifier_fused   replaces the teaching forward kernel (a probs buffer, three reads of the row) followed by
                     the teaching backward kernel: one block per row; the max and the sum in one read of the
                     row (row_stats: each thread a running max m and sum of exp(x - m), rescaled when m grows,
                     four columns per step, all four loads first), the loss, then a second read that writes
                     dlogits = (softmax - onehot) * dloss straight over the logits, each thread's columns last
                     to first (the end of the row, read last, is the likeliest still in L2). No probs: 2 reads
                     + 1 write of a row, against the teaching pair's 4 reads + 2 writes.
  classifier_loss    the fused kernel's first half (validation, the forward): the losses, one read, nothing
                     written over the logits.
Paired (float32 and bf16 logits, Vp even, word-aligned): the _pairs kernels read words of two columns with
half the threads; thread j does the scalar kernel's threads 2j and 2j+1 (their columns are the two halves of
the same words) and reduces over the same tree.
Contract: the paired kernels give the scalar kernels' bits at twice their block. Against the teaching
kernels: losses and dlogits within 2e-6 relative (normwise), both sets lying within 1e-6 of the float64
reference in float32 (the exponentials are float32 here, float64 there; the sums float64 in both).
"""
import math

import numba
from numba import cuda

from ..kernels.bf16 import load, store
from ..kernels.norm import MAX_BLOCK, block_max, block_sum
from .device_helpers import load_pair, pair_view, pairs_apply, store_pair

# threads per row of the fused and loss kernels on the GPU. ptxas (sm_90) gives the fused kernel 40 registers
# per thread (float32 and bf16): three blocks of 512 per SM, 75% occupancy (1024 would fit one block per SM:
# every reduction would idle the SM), and about 400 rows in flight, ~40 MB of bf16 logits: what L2 can still
# hold for the second read. The paired kernels run ROW_BLOCK // 2 = 256 threads (standing for 512): ptxas
# gives the fused one 59 registers (bf16) / 64 (float32), so four blocks per SM, 1024 threads with four 4- or
# 8-byte loads each in flight, about 530 rows (~53 MB of bf16) at a time.
ROW_BLOCK = 512


# ---- Numba kernels: a block per row, shared memory --------------------------------------------------
@cuda.jit(device=True)
def four_step(m, s, x0, x1, x2, x3):
    """row_stats' step over four columns: (m, s) -> the running max and the sum of exp(x - m) with x0..x3 in."""
    mx = max(max(x0, x1), max(x2, x3))
    # a new max: rescale the sum to it
    if mx > m:
        s *= math.exp(m - mx)
        m = mx
    # the four exponentials, summed in a fixed order (float64)
    s += ((numba.float64(math.exp(x0 - m)) + math.exp(x1 - m)) + math.exp(x2 - m)) + math.exp(x3 - m)
    return m, s


@cuda.jit(device=True)
def one_step(m, s, x):
    """row_stats' step over one column: (m, s) with x in."""
    if x > m:
        # x is the new max: the old sum rescaled, plus exp(0)
        return x, s * math.exp(m - x) + 1.0
    return m, s + math.exp(x - m)


@cuda.jit(device=True)
def row_stats(logits, r, V, buf):
    """logits: (rows, Vp); buf: float64 shared scratch of >= blockDim. All threads of the block call it.
    Returns (m, maxval, shift, total): this thread's running max m (in the logits' dtype, >= every logit of its
    columns v = tid, tid + nt, ... < V), the row max, exp(m - maxval) and the row's sum of exp(x - maxval)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    # each thread over its strided columns: a running max m and s = sum of exp(x - m), rescaled when m grows.
    # m starts at column 0's logit: a value of the row (so m <= the row max), in the logits' dtype (so the
    # exponentials are float32 ones for float32 and bf16 logits); the sums are float64
    m = load(logits, (r, 0))
    s = 0.0
    # four columns per step, loaded before any math (four loads in flight), summed in a fixed order
    v = tid
    while v + 3 * nt < V:
        x0 = load(logits, (r, v))
        x1 = load(logits, (r, v + nt))
        x2 = load(logits, (r, v + 2 * nt))
        x3 = load(logits, (r, v + 3 * nt))
        m, s = four_step(m, s, x0, x1, x2, x3)
        v += 4 * nt
    # the last few columns one at a time
    while v < V:
        m, s = one_step(m, s, load(logits, (r, v)))
        v += nt
    # the row max: the largest m of the block
    buf[tid] = m
    cuda.syncthreads()
    block_max(buf, tid, nt)
    maxval = buf[0]
    cuda.syncthreads()                      # everyone has read the max before buf is reused
    # the sum of exp(x - max): each thread's s rescaled to the row max, then the block's sum
    shift = math.exp(m - maxval)
    buf[tid] = s * shift
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    return m, maxval, shift, buf[0]


@cuda.jit(device=True)
def dlogit(x, v, V, target, m, scale, dloss):
    """Column v's (softmax - onehot(target)) * dloss from its logit x <= m: exp(x - m) * scale is its
    probability (scale = exp(m - max) / sum). Padded columns (v >= V) get no gradient."""
    if v >= V:
        return 0.0
    p = math.exp(x - m) * scale
    return (p - 1.0 if v == target else p) * dloss


@cuda.jit
def classifier_loss_kernel(losses, logits, targets, V):
    """One block per row r = b*T + t. logits: (B*T, Vp); targets, losses: (B*T,). Overwrites losses; one read
    of the row, nothing else written."""
    r = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # max and sum in one read
    _, maxval, _, total = row_stats(logits, r, V, buf)
    # loss = log(sum) - (logit[target] - max)
    if cuda.threadIdx.x == 0:
        losses[r] = math.log(total) - (load(logits, (r, targets[r])) - maxval)


@cuda.jit
def classifier_fused_kernel(losses, logits, targets, dloss, V):
    """One block per row r = b*T + t. logits: (B*T, Vp); targets, losses: (B*T,). Overwrites losses, and the
    logits with dlogits = (softmax - onehot(target)) * dloss, 0 on the padded columns (in place, as llm.c:
    no second buffer, and the simulator copies each array argument, so two names for one buffer would lose
    writes there). Reads the row twice, writes it once; no probs."""
    r, tid, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x      # row, thread, threads
    Vp = logits.shape[1]
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    t = targets[r]
    # the target's logit, read before anything is written over the logits (row_stats syncs the block first)
    xt = load(logits, (r, t))
    # max and sum in one read
    m, maxval, shift, total = row_stats(logits, r, V, buf)
    # loss = log(sum) - (logit[target] - max)
    if tid == 0:
        losses[r] = math.log(total) - (xt - maxval)
    # dlogits over this thread's columns again (each element read, then overwritten, by the same thread), last to
    # first: the end of the row, read last, is the likeliest still in L2. Four per step: four loads in flight,
    # then four stores
    scale = shift / total
    v = tid + ((Vp - 1 - tid) // nt) * nt   # this thread's last column (< tid when it has none)
    while v >= tid + 3 * nt:
        x0 = load(logits, (r, v))
        x1 = load(logits, (r, v - nt))
        x2 = load(logits, (r, v - 2 * nt))
        x3 = load(logits, (r, v - 3 * nt))
        store(logits, (r, v), dlogit(x0, v, V, t, m, scale, dloss))
        store(logits, (r, v - nt), dlogit(x1, v - nt, V, t, m, scale, dloss))
        store(logits, (r, v - 2 * nt), dlogit(x2, v - 2 * nt, V, t, m, scale, dloss))
        store(logits, (r, v - 3 * nt), dlogit(x3, v - 3 * nt, V, t, m, scale, dloss))
        v -= 4 * nt
    while v >= tid:
        store(logits, (r, v), dlogit(load(logits, (r, v)), v, V, t, m, scale, dloss))
        v -= nt


# ---- paired kernels: two columns per load (float32 and bf16) -------------------------------------------
# The logits as pair_view words (Vp even): a bf16 row as Vp/2 uint32 words, a float32 row as Vp/2 uint64
# words, word w = columns 2w (low half) and 2w+1. A block of nt threads stands for row_stats' block of 2nt:
# thread j is its threads 2j and 2j+1, whose columns 2j + 2k nt and 2j+1 + 2k nt are the two halves of word
# j + k nt (k = 0, 1, ...). Thread j keeps both threads' running max and sum, (ma, sa) for the low halves,
# (mb, sb) for the high halves, takes their steps of four columns from four words (eight columns, four loads
# in flight) and reduces the 2nt values over the same tree: the scalar kernels' numbers at block 2nt.
@cuda.jit(device=True)
def row_stats_pairs(logits, r, V, buf):
    """logits: (rows, Vp/2) paired view; buf: float64 shared scratch of >= 2 blockDim. All threads of the block
    call it. row_stats at block 2 blockDim, thread j as its threads 2j and 2j+1 (see above): returns (ma, mb,
    maxval, shift_a, shift_b, total), their m's and shifts, the row max and the sum, the same bits."""
    j = cuda.threadIdx.x
    nt = cuda.blockDim.x
    # both start at column 0's logit, the sums at 0 (float64)
    x0, _ = load_pair(logits, (r, 0))
    ma, mb = x0, x0
    sa, sb = 0.0, 0.0
    # row_stats' steps of four: columns 2w + 2i nt (low halves) and 2w+1 + 2i nt (high halves), i = 0..3, of
    # words w + i nt; the four loads first. The high halves' last column is the larger: both threads step while
    # it is < V
    w = j
    while 2 * (w + 3 * nt) + 1 < V:
        a0, b0 = load_pair(logits, (r, w))
        a1, b1 = load_pair(logits, (r, w + nt))
        a2, b2 = load_pair(logits, (r, w + 2 * nt))
        a3, b3 = load_pair(logits, (r, w + 3 * nt))
        ma, sa = four_step(ma, sa, a0, a1, a2, a3)
        mb, sb = four_step(mb, sb, b0, b1, b2, b3)
        w += 4 * nt
    if 2 * (w + 3 * nt) < V:
        # V odd, column V-1 the low half of word w + 3nt: thread 2j takes one more step of four (its last),
        # thread 2j+1 its last three columns one at a time (its fourth would be column V)
        a0, b0 = load_pair(logits, (r, w))
        a1, b1 = load_pair(logits, (r, w + nt))
        a2, b2 = load_pair(logits, (r, w + 2 * nt))
        a3, _ = load_pair(logits, (r, w + 3 * nt))
        ma, sa = four_step(ma, sa, a0, a1, a2, a3)
        mb, sb = one_step(mb, sb, b0)
        mb, sb = one_step(mb, sb, b1)
        mb, sb = one_step(mb, sb, b2)
    else:
        # the last few columns one at a time, the high half only where it is < V
        while 2 * w < V:
            a0, b0 = load_pair(logits, (r, w))
            ma, sa = one_step(ma, sa, a0)
            if 2 * w + 1 < V:
                mb, sb = one_step(mb, sb, b0)
            w += nt
    # the row max over the 2nt m's (slot 2j: thread 2j's), the tree of block_max
    buf[2 * j] = ma
    buf[2 * j + 1] = mb
    cuda.syncthreads()
    block_max(buf, j, 2 * nt)
    maxval = buf[0]
    cuda.syncthreads()                      # everyone has read the max before buf is reused
    # the sum of exp(x - max): each s rescaled to the row max, then the tree of block_sum
    shift_a = math.exp(ma - maxval)
    shift_b = math.exp(mb - maxval)
    buf[2 * j] = sa * shift_a
    buf[2 * j + 1] = sb * shift_b
    cuda.syncthreads()
    block_sum(buf, j, 2 * nt)
    return ma, mb, maxval, shift_a, shift_b, buf[0]


@cuda.jit(device=True)
def target_logit_pairs(logits, r, t):
    """Column t's logit from a paired view: the low or high half of word t // 2."""
    x0, x1 = load_pair(logits, (r, t // 2))
    return x1 if t % 2 else x0


@cuda.jit
def classifier_loss_pairs_kernel(losses, logits, targets, V):
    """classifier_loss_kernel on a paired view logits: (B*T, Vp/2), launched with half its block: the same loss
    bits. Overwrites losses."""
    r = cuda.blockIdx.x
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # max and sum in one read
    _, _, maxval, _, _, total = row_stats_pairs(logits, r, V, buf)
    # loss = log(sum) - (logit[target] - max)
    if cuda.threadIdx.x == 0:
        losses[r] = math.log(total) - (target_logit_pairs(logits, r, targets[r]) - maxval)


@cuda.jit
def classifier_fused_pairs_kernel(losses, logits, targets, dloss, V):
    """classifier_fused_kernel on a paired view logits: (B*T, Vp/2), launched with half its block (nt threads for
    its 2nt): the same losses and dlogits, bit for bit. Overwrites losses, and the logits with dlogits in place."""
    r, j, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x        # row, thread (word), threads
    W = logits.shape[1]
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    t = targets[r]
    # the target's logit, read before anything is written over the logits (row_stats_pairs syncs first)
    xt = target_logit_pairs(logits, r, t)
    # max and sum in one read
    ma, mb, maxval, shift_a, shift_b, total = row_stats_pairs(logits, r, V, buf)
    # loss = log(sum) - (logit[target] - max)
    if j == 0:
        losses[r] = math.log(total) - (xt - maxval)
    # dlogits over this thread's words again, last to first, four words (loads) then four stores per step; the
    # low halves with thread 2j's m and scale, the high halves with thread 2j+1's
    scale_a = shift_a / total
    scale_b = shift_b / total
    w = j + ((W - 1 - j) // nt) * nt        # this thread's last word (< j when it has none)
    while w >= j + 3 * nt:
        a0, b0 = load_pair(logits, (r, w))
        a1, b1 = load_pair(logits, (r, w - nt))
        a2, b2 = load_pair(logits, (r, w - 2 * nt))
        a3, b3 = load_pair(logits, (r, w - 3 * nt))
        store_pair(logits, (r, w), dlogit(a0, 2 * w, V, t, ma, scale_a, dloss),
                   dlogit(b0, 2 * w + 1, V, t, mb, scale_b, dloss))
        u = w - nt
        store_pair(logits, (r, u), dlogit(a1, 2 * u, V, t, ma, scale_a, dloss),
                   dlogit(b1, 2 * u + 1, V, t, mb, scale_b, dloss))
        u = w - 2 * nt
        store_pair(logits, (r, u), dlogit(a2, 2 * u, V, t, ma, scale_a, dloss),
                   dlogit(b2, 2 * u + 1, V, t, mb, scale_b, dloss))
        u = w - 3 * nt
        store_pair(logits, (r, u), dlogit(a3, 2 * u, V, t, ma, scale_a, dloss),
                   dlogit(b3, 2 * u + 1, V, t, mb, scale_b, dloss))
        w -= 4 * nt
    while w >= j:
        a0, b0 = load_pair(logits, (r, w))
        store_pair(logits, (r, w), dlogit(a0, 2 * w, V, t, ma, scale_a, dloss),
                   dlogit(b0, 2 * w + 1, V, t, mb, scale_b, dloss))
        w -= nt


# ---- the layer ---------------------------------------------------------------------------------
def row_block(dev) -> int:
    """Threads per row (one block) of the fused and loss kernels: ROW_BLOCK on the GPU, dev.block_size in the
    simulator (each of its threads is a Python thread)."""
    return dev.block_size if dev.kind == "sim" else ROW_BLOCK


def row_pairs_apply(x) -> bool:
    """The paired fused and loss kernels apply to the (rows, Vp) logits x: float32 or bf16, Vp even (the padded
    vocabulary is), x starting on a word boundary."""
    return x.shape[-1] % 2 == 0 and pairs_apply(x)


def classifier_fused(dev, losses, logits, targets, dloss, vocab_size) -> None:
    """logits: (B,T,Vp); targets: (B,T) int32; losses: (B,T); dloss: float. Overwrites losses, and logits
    with dlogits = (softmax - onehot(target)) * dloss (in place)."""
    Vp = logits.shape[-1]
    rows = logits.size // Vp
    x = logits.reshape(rows, Vp)
    if row_pairs_apply(x):
        dev.launch(classifier_fused_pairs_kernel, rows, row_block(dev) // 2, losses.reshape(-1), pair_view(x),
                   targets.reshape(-1), float(dloss), vocab_size)
        return
    dev.launch(classifier_fused_kernel, rows, row_block(dev), losses.reshape(-1), x,
               targets.reshape(-1), float(dloss), vocab_size)


def classifier_loss(dev, losses, logits, targets, vocab_size) -> None:
    """logits: (B,T,Vp); targets: (B,T) int32; losses: (B,T). Overwrites losses (the logits stay as they are)."""
    Vp = logits.shape[-1]
    rows = logits.size // Vp
    x = logits.reshape(rows, Vp)
    if row_pairs_apply(x):
        dev.launch(classifier_loss_pairs_kernel, rows, row_block(dev) // 2, losses.reshape(-1), pair_view(x),
                   targets.reshape(-1), vocab_size)
        return
    dev.launch(classifier_loss_kernel, rows, row_block(dev), losses.reshape(-1), x, targets.reshape(-1),
               vocab_size)
