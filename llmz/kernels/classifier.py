"""The classifier's loss: softmax over the first V of Vp logits, then cross-entropy with the targets (llm.c's
train_gpt2.c softmax_forward + crossentropy_forward, and crossentropy_softmax_backward):

    probs[v] = exp(logits[v] - max) / sum_{u<V} exp(logits[u] - max)    for v < V;   0 for V <= v < Vp
    loss     = -log(probs[target]) = log(sum) - (logits[target] - max)
    dlogits  = (probs - onehot(target)) * dloss                           for v < V;   0 for V <= v < Vp

logits, probs, dlogits: (B,T,Vp); targets, losses: (B,T). The padded columns (V <= v < Vp, llm.c pads the
vocabulary to a multiple of 128) never enter the max or the sum, whatever they hold, and get a zero gradient.
The loss is log(sum) - (logit - max): -log(probs[target]) without rounding the probability first (never
log(0)). Targets must lie in [0, V): nothing checks them (that would need a host synchronisation).
Kernels: forward, one block per row, three reads of the row (the max, the sum of exp in float64, then probs);
overwrites losses and probs. Backward, one thread per element; overwrites dlogits. The model runs the two as
classifier_loss (forward, the losses only) and classifier_fused (losses, then dlogits written over the
logits): here the forward kernel into a probs scratch buffer, then the backward kernel (llmz.fast.classifier
fuses them into one kernel, llm.c's fused_classifier). logits, probs and dlogits are float32, float64 or
uint16 (bf16 bits, computed in float32, results rounded to nearest), through llmz.kernels.bf16's load /
store; losses keep the dtype they are given (float32 beside bf16 logits).
"""
import math

import numba
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store
from .grid import ceil_div
from .norm import MAX_BLOCK, block_total


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


def classifier_loss_ref(losses, logits, targets, vocab_size):
    """logits: (B,T,Vp); targets, losses: (B,T). Overwrites losses; the logits stay as they are (the probs go
    into a temporary)."""
    classifier_forward_ref(losses, np.empty_like(logits), logits, targets, vocab_size)


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
    m = np.float64(-math.inf)
    for v in range(tid, V, nt):
        m = max(m, numba.float64(load(logits, (r, v))))
    maxval = block_total(buf, m, True)
    # sum of exp(x - max), accumulated in float64
    s = np.float64(0.0)
    for v in range(tid, V, nt):
        s += math.exp(load(logits, (r, v)) - maxval)
    total = block_total(buf, s, False)
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


# ---- the layer: the kernels' launches -----------------------------------------------------------
def classifier_forward(dev, losses, probs, logits, targets, vocab_size) -> None:
    """logits, probs: (B,T,Vp), two different arrays; targets: (B,T) int32; losses: (B,T). Overwrites losses
    and probs."""
    Vp = logits.shape[-1]
    rows = logits.size // Vp
    dev.launch(classifier_forward_kernel, rows, min(dev.block_size, MAX_BLOCK),
               losses.reshape(-1), probs.reshape(rows, Vp), logits.reshape(rows, Vp), targets.reshape(-1),
               vocab_size)


def classifier_backward(dev, dlogits, probs, targets, dloss, vocab_size) -> None:
    """dlogits, probs: (B,T,Vp); targets: (B,T); dloss: float. Overwrites dlogits (may be the logits buffer)."""
    Vp = probs.shape[-1]
    n = probs.size
    dev.launch(classifier_backward_kernel, ceil_div(n, dev.block_size), dev.block_size,
               dlogits.reshape(-1), probs.reshape(-1), targets.reshape(-1), float(dloss), vocab_size, Vp, n)


def classifier_loss(dev, losses, logits, targets, vocab_size) -> None:
    """logits: (B,T,Vp); targets: (B,T) int32; losses: (B,T). Overwrites losses; the logits stay as they are
    (the forward kernel writes its probs into a scratch buffer)."""
    probs = dev.scratch("classifier_probs", logits.shape, logits.dtype)
    classifier_forward(dev, losses, probs, logits, targets, vocab_size)


def classifier_fused(dev, losses, logits, targets, dloss, vocab_size) -> None:
    """logits: (B,T,Vp); targets: (B,T) int32; losses: (B,T); dloss: float. Overwrites losses, and logits with
    dlogits = (softmax - onehot(target)) * dloss: the forward kernel (probs into a scratch buffer), then the
    backward kernel over the logits."""
    probs = dev.scratch("classifier_probs", logits.shape, logits.dtype)
    classifier_forward(dev, losses, probs, logits, targets, vocab_size)
    classifier_backward(dev, logits, probs, targets, dloss, vocab_size)
