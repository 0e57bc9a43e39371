"""The classifier's loss: softmax over the first V of Vp logits, then cross-entropy with the targets.

    probs[v] = exp(logits[v] - max) / sum_{u<V} exp(logits[u] - max)    for v < V;   0 for V <= v < Vp
    loss     = -log(probs[target]) = log(sum) - (logits[target] - max)
    dlogits  = (probs - onehot(target)) * dloss                           for v < V;   0 for V <= v < Vp

The padded columns (V <= v < Vp, llm.c pads the vocabulary to a multiple of 128) never enter the max or the
sum, whatever they hold, and get a zero gradient. The loss is computed as log(sum) - (logit - max), the same
number as -log(probs[target]) but without rounding the probability first (and never log(0)).
Targets must lie in [0, V): nothing checks them (that would need a host synchronisation).

Kernels (the teaching versions): forward, one block per row, three reads of the row (max, sum of exp in
float64, write probs); backward, one thread per element of the flat arrays (a 64-bit division per element
to find its row). Fast versions, GPU only (the simulator runs the teaching ones; the fast ones need nothing it
lacks, and the tests run them there too):
  forward, online   one read of the row for max and sum together: each thread keeps a running max m and the
                    sum of exp(x - m), rescaled by exp(m_old - m_new) when m grows; the block takes the max of
                    the m's and sums each thread's sum rescaled to it; a second read writes the probs. The
                    exponentials are in the logits' dtype (expf for float32), the sums in float64
                    (before: 7.0 ms per d12 step, ~940 GB/s).
  backward, rows    grid (rows, column blocks), as matmul_bias_kernel: the row is the block's, no division
                    (before: 3.55 ms per d12 step).
Fused (llm.c's fused_classifier_kernel), in place, what the model runs (in the simulator; on the GPU their
paired versions, below):
  fused             one block per row: the max and sum in one read of the row (row_stats), the loss, then a
                    second read that writes dlogits = (softmax - onehot) * dloss straight over the logits. No
                    probs: 2 reads + 1 write of a row where the online forward + rows backward made 3 reads +
                    2 writes (they took 4.07 + 3.24 ms per d12 step, B=16, T=1024, bf16). The second read goes
                    over each thread's columns last to first: it starts with what the first left in L2.
  loss              the fused kernel's first half: the losses only, one read of the row, nothing written.
The model's forward runs the loss kernel (validation needs no more), its backward the fused kernel, which
computes the same losses again: a training step that asks forward for logits only (no targets) and reads the
losses after backward reads each row twice instead of three times.
row_stats reads four columns per thread per step, all four loads before any math (one 2-byte load at a time
left the online kernel latency-bound), in a fixed order: the bits repeat. The online forward uses it too, and
its layer launches it at the fused kernel's block size: all three kernels give the same losses, bit for bit.

Paired (GPU, float32 and bf16 logits, Vp even): the fused and loss kernels' layers launch
classifier_fused_pairs_kernel / classifier_loss_pairs_kernel on llmz.kernels.bf16's pair_view of the logits
(word w = columns 2w and 2w+1: one 4-byte load for bf16, one 8-byte load for float32) with half the threads.
Thread j is the scalar kernel's threads 2j and 2j+1 (their columns are the two halves of the same words), keeps
both running maxes and sums, takes both their steps of four columns from four word loads, and reduces over the
scalar kernel's tree: the same arithmetic on the same values, so the same losses and dlogits, bit for bit,
as the scalar kernels at row_block threads (and as the online forward). The "before" (scalar, 2-byte loads,
a warp moving 64 bytes per load instruction; bf16 d12 B=16 T=1024 on an H200 of ~4.8 TB/s): fused 3.02 ms per
step, ~1.1 TB/s as 2 reads + 1 write; after: 2.74 ms (at 4096 rows: 0.695 against 0.762 ms). The scalar kernels stay for float64, odd Vp and the simulator's layers.

logits, probs and dlogits are float32, float64 or uint16 (bf16 bits, computed in float32, results rounded to
nearest), each on its own: the kernels read and write them through llmz.kernels.bf16's load / store. losses
keep the dtype they are given (float32 beside bf16 logits); targets are integers.
"""
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, load_pair, pair_view, store, store_pair
from .gelu import pairs_apply
from .norm import MAX_BLOCK, block_max, block_sum

# threads per row of the fused and loss kernels on the GPU. ptxas (sm_90) gives the fused kernel 40 registers
# per thread (float32 and bf16): three blocks of 512 per SM, 75% occupancy (1024 would fit one block per SM:
# every reduction would idle the SM), and about 400 rows in flight, ~40 MB of bf16 logits: what L2 can still
# hold for the second read. Not yet tuned on the GPU. The paired kernels run ROW_BLOCK // 2 = 256 threads
# (standing for 512): ptxas gives the fused one 59 registers (bf16) / 64 (float32), so four blocks per SM,
# 1024 threads with four 4- or 8-byte loads each in flight, about 530 rows (~53 MB of bf16) at a time.
ROW_BLOCK = 512


# ---- NumPy reference ----------------------------------------------------------------------------
def classifier_forward_ref(losses, probs, logits, targets, vocab_size):
    """logits, probs: (B,T,Vp); targets: (B,T) int; losses: (B,T). Overwrites losses and probs (which may be
    the logits buffer: the fused reference computes them in place)."""
    if is_bf16(probs) or is_bf16(logits):
        # losses: a float array, written in place
        return run_in_f32(lambda lo, p, x: classifier_forward_ref(lo, p, x, targets, vocab_size),
                          (losses, probs, logits), written=(0, 1))
    V = vocab_size
    x = logits[..., :V]
    # subtract the row max so exp never overflows
    maxval = x.max(axis=-1, keepdims=True)
    # the target's logit, read before probs (maybe the same buffer) is written
    xt = np.take_along_axis(x, targets[..., None].astype(np.intp), axis=-1)
    p = probs[..., :V]                      # computed in place in probs: no (B,T,V) temporaries
    np.subtract(x, maxval, out=p)
    np.exp(p, out=p)
    s = p.sum(axis=-1, keepdims=True)
    # normalise; padded columns are zero
    p /= s
    probs[..., V:] = 0
    # loss = -log p[target] = log(sum) - (logit[target] - max)
    losses[...] = (np.log(s) - (xt - maxval))[..., 0]


def classifier_backward_ref(dlogits, probs, targets, dloss, vocab_size):
    """dlogits, probs: (B,T,Vp); targets: (B,T); dloss: a float, d(loss)/d(losses[b,t]) for every b,t.
    Overwrites dlogits (which may be the logits buffer, or probs itself: the fused reference)."""
    if is_bf16(dlogits) or is_bf16(probs):
        return run_in_f32(lambda d, p: classifier_backward_ref(d, p, targets, dloss, vocab_size),
                          (dlogits, probs), written=(0,))
    V = vocab_size
    # (probs - onehot(target)) * dloss on the real columns
    t = targets[..., None].astype(np.intp)
    dlogits[..., :V] = probs[..., :V]
    np.put_along_axis(dlogits, t, np.take_along_axis(probs, t, axis=-1) - 1, axis=-1)
    dlogits[..., :V] *= dloss
    # padded columns get no gradient
    dlogits[..., V:] = 0


def classifier_fused_ref(losses, logits, targets, dloss, vocab_size):
    """logits: (B,T,Vp); targets, losses: (B,T); dloss: a float. Overwrites losses, and logits with dlogits:
    the forward reference with its probs computed in place over the logits, then the backward reference in
    place over the probs. bf16 storage: computed in float32, dlogits rounded once (as the kernel does)."""
    if is_bf16(logits):
        return run_in_f32(lambda lo, x: classifier_fused_ref(lo, x, targets, dloss, vocab_size),
                          (losses, logits), written=(0, 1))
    classifier_forward_ref(losses, logits, logits, targets, vocab_size)
    classifier_backward_ref(logits, logits, targets, dloss, vocab_size)


# ---- Numba kernels ------------------------------------------------------------------------------
@cuda.jit
def classifier_forward_kernel(losses, probs, logits, targets, V):
    """One block per row r = b*T + t. logits, probs: (B*T, Vp); targets, losses: (B*T,)."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    Vp = logits.shape[1]
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # row max: each thread over its strided columns, then across the block
    m = -math.inf
    for v in range(tid, V, nt):
        m = max(m, numba.float64(load(logits, (r, v))))
    buf[tid] = m
    cuda.syncthreads()
    block_max(buf, tid, nt)
    maxval = buf[0]
    cuda.syncthreads()                      # everyone has read the max before buf is reused
    # sum of exp(x - max), accumulated in float64
    s = 0.0
    for v in range(tid, V, nt):
        s += math.exp(load(logits, (r, v)) - maxval)
    buf[tid] = s
    cuda.syncthreads()
    block_sum(buf, tid, nt)
    total = buf[0]
    # normalise; padded columns are zero
    for v in range(tid, Vp, nt):
        store(probs, (r, v), math.exp(load(logits, (r, v)) - maxval) / total if v < V else 0.0)
    # loss = log(sum) - (logit[target] - max)
    if tid == 0:
        losses[r] = math.log(total) - (load(logits, (r, targets[r])) - maxval)


@cuda.jit
def classifier_backward_kernel(dlogits, probs, targets, dloss, V, Vp, n):
    """One thread per element i of the flat (B*T*Vp) arrays. Overwrites dlogits (may alias logits)."""
    i = cuda.grid(1)
    if i < n:
        r = i // Vp
        v = i - r * Vp
        if v < V:
            # (p - onehot(target)) * dloss
            g = load(probs, i) - (1.0 if v == targets[r] else 0.0)
            store(dlogits, i, g * dloss)
        else:
            # padded columns get no gradient
            store(dlogits, i, 0.0)


# ---- fast Numba kernels: block per row, shared memory only (they run in the simulator too) ---------
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
def classifier_forward_online_kernel(losses, probs, logits, targets, V):
    """One block per row r = b*T + t. logits, probs: (B*T, Vp); targets, losses: (B*T,). Overwrites losses and
    probs. Reads the row twice (max and sum together, then probs), where the teaching kernel reads it thrice."""
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    Vp = logits.shape[1]
    buf = cuda.shared.array(MAX_BLOCK, numba.float64)
    # max and sum in one read
    m, maxval, shift, total = row_stats(logits, r, V, buf)
    # normalise: exp(x - max) / sum = exp(x - m) * (exp(m - max) / sum), x <= m on this thread's columns;
    # padded columns are zero
    scale = shift / total
    for v in range(tid, Vp, nt):
        store(probs, (r, v), math.exp(load(logits, (r, v)) - m) * scale if v < V else 0.0)
    # loss = log(sum) - (logit[target] - max)
    if tid == 0:
        losses[r] = math.log(total) - (load(logits, (r, targets[r])) - maxval)


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
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
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


# ---- paired kernels: two columns per load (float32 and bf16 on the GPU) ----------------------------------
# The logits as llmz.kernels.bf16's pair_view words (Vp even): a bf16 row as Vp/2 uint32 words, a float32 row as
# Vp/2 uint64 words, word w = columns 2w (low half) and 2w+1. A block of nt threads stands for row_stats' block
# of 2nt: thread j is its threads 2j and 2j+1, whose columns 2j + 2k nt and 2j+1 + 2k nt are the two halves of
# word j + k nt (k = 0, 1, ...). Thread j keeps both threads' running max and sum, (ma, sa) for the low halves, (mb, sb) for
# the high halves, takes their steps of four columns from four words (eight columns, four loads in flight) and
# reduces the 2nt values over the same tree: the scalar kernels' numbers at block 2nt, bit for bit.
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
    r = cuda.blockIdx.x
    j = cuda.threadIdx.x
    nt = cuda.blockDim.x
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


@cuda.jit
def classifier_backward_rows_kernel(dlogits, probs, targets, dloss, V):
    """dlogits, probs: (B*T, Vp); targets: (B*T,). Grid (B*T, ceil(Vp/blockDim)): block (r, j) takes columns
    j*blockDim + tid of row r. Overwrites dlogits (may alias logits)."""
    r = cuda.blockIdx.x
    v = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if v < probs.shape[1]:
        if v < V:
            # (p - onehot(target)) * dloss
            g = load(probs, (r, v)) - (1.0 if v == targets[r] else 0.0)
            store(dlogits, (r, v), g * dloss)
        else:
            # padded columns get no gradient
            store(dlogits, (r, v), 0.0)


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def row_block(dev) -> int:
    """Threads per row (one block) of the fused and loss kernels: ROW_BLOCK on the GPU, dev.block_size in the
    simulator."""
    return ROW_BLOCK if dev.kind == "gpu" else dev.block_size


def row_pairs_apply(dev, x) -> bool:
    """The paired fused and loss kernels apply to the (rows, Vp) logits x: on the GPU, float32 or bf16, Vp even
    (the padded vocabulary is), x starting on a word boundary (llmz.kernels.gelu.pairs_apply). They run at
    half row_block's threads, so they stand for the scalar kernels at row_block: the same bits."""
    return x.shape[-1] % 2 == 0 and pairs_apply(dev, x)


def classifier_forward(dev, losses, probs, logits, targets, vocab_size):
    """logits, probs: (B,T,Vp); targets: (B,T) int32; losses: (B,T). Overwrites losses and probs."""
    if not dev.kernels:
        return classifier_forward_ref(losses, probs, logits, targets, vocab_size)
    Vp = logits.shape[-1]
    rows = logits.size // Vp
    # the online kernel at the fused kernel's block size: the same row statistics, the same loss bits
    kernel, block = ((classifier_forward_online_kernel, row_block(dev)) if dev.kind == "gpu" else
                     (classifier_forward_kernel, min(dev.block_size, MAX_BLOCK)))
    dev.launch(kernel, rows, block,
               losses.reshape(-1), probs.reshape(rows, Vp), logits.reshape(rows, Vp), targets.reshape(-1),
               vocab_size)


def classifier_backward(dev, dlogits, probs, targets, dloss, vocab_size):
    """dlogits, probs: (B,T,Vp); targets: (B,T); dloss: float. Overwrites dlogits (may alias logits)."""
    if not dev.kernels:
        return classifier_backward_ref(dlogits, probs, targets, dloss, vocab_size)
    Vp = probs.shape[-1]
    n = probs.size
    if dev.kind == "gpu":
        rows = n // Vp
        dev.launch(classifier_backward_rows_kernel, (rows, ceil_div(Vp, dev.block_size)), dev.block_size,
                   dlogits.reshape(rows, Vp), probs.reshape(rows, Vp), targets.reshape(-1), float(dloss),
                   vocab_size)
    else:
        dev.launch(classifier_backward_kernel, ceil_div(n, dev.block_size), dev.block_size,
                   dlogits.reshape(-1), probs.reshape(-1), targets.reshape(-1), float(dloss), vocab_size, Vp, n)


def classifier_fused(dev, losses, logits, targets, dloss, vocab_size):
    """logits: (B,T,Vp); targets: (B,T) int32; losses: (B,T); dloss: float. Overwrites losses, and logits
    with dlogits = (softmax - onehot(target)) * dloss (in place)."""
    if not dev.kernels:
        return classifier_fused_ref(losses, logits, targets, dloss, vocab_size)
    Vp = logits.shape[-1]
    rows = logits.size // Vp
    x = logits.reshape(rows, Vp)
    if row_pairs_apply(dev, x):
        dev.launch(classifier_fused_pairs_kernel, rows, row_block(dev) // 2, losses.reshape(-1), pair_view(x),
                   targets.reshape(-1), float(dloss), vocab_size)
        return
    dev.launch(classifier_fused_kernel, rows, row_block(dev), losses.reshape(-1), x,
               targets.reshape(-1), float(dloss), vocab_size)


def classifier_loss(dev, losses, logits, targets, vocab_size):
    """logits: (B,T,Vp); targets: (B,T) int32; losses: (B,T). Overwrites losses (the logits stay as they are).
    On cpu the NumPy reference computes the probabilities into a temporary; the kernel writes none."""
    if not dev.kernels:
        return classifier_forward_ref(losses, np.empty_like(logits), logits, targets, vocab_size)
    Vp = logits.shape[-1]
    rows = logits.size // Vp
    x = logits.reshape(rows, Vp)
    if row_pairs_apply(dev, x):
        dev.launch(classifier_loss_pairs_kernel, rows, row_block(dev) // 2, losses.reshape(-1), pair_view(x),
                   targets.reshape(-1), vocab_size)
        return
    dev.launch(classifier_loss_kernel, rows, row_block(dev), losses.reshape(-1), x, targets.reshape(-1),
               vocab_size)
