"""The encoder: token embedding plus position embedding (llm.c: encoder_forward / encoder_backward).

    out[b,t,:] = wte[inp[b,t], :] + wpe[t, :]
    backward: dwte[inp[b,t], :] += dout[b,t,:],   dwpe[t, :] += sum_b dout[b,t,:]

out: (B,T,C); inp: (B,T) int token ids; wte: (Vp,C); wpe: (maxT,C), T <= maxT. Kernels, deterministic (no
float atomics):
  forward       one thread per (b,t,c); overwrites out
  backward wpe  one thread per (t,c), summing over b in order; accumulates (+=) into dwpe
  backward wte  one thread per channel c, looping over all (b,t) in order, so repeated tokens add up without
                atomics (llm.c's dev/cuda/encoder_backward.cu, deterministic); accumulates (+=) into dwte
out, wte, wpe and the gradients are float32, float64 or uint16 (bf16 bits, computed in float32, results
rounded to nearest), each on its own, through llmz.kernels.bf16's load / store / store_add. In bf16 the wte
kernel rounds dwte after every add (a token seen k times is rounded k times).
"""
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store, store_add
from .grid import ceil_div


# ---- NumPy reference ----------------------------------------------------------------------------
def encoder_forward_ref(out, inp, wte, wpe):
    """out: (B,T,C); inp: (B,T) int token ids; wte: (Vp,C); wpe: (maxT,C), T <= maxT. Overwrites out."""
    if is_bf16(out) or is_bf16(wte) or is_bf16(wpe):
        return run_in_f32(lambda o, e, p: encoder_forward_ref(o, inp, e, p), (out, wte, wpe), written=(0,))
    T = inp.shape[1]
    # token row plus position row
    out[...] = wte[inp] + wpe[:T]


def encoder_backward_ref(dwte, dwpe, dout, inp):
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T). Accumulates (+=) into dwte, dwpe."""
    if is_bf16(dwte) or is_bf16(dwpe) or is_bf16(dout):
        return run_in_f32(lambda e, p, d: encoder_backward_ref(e, p, d, inp), (dwte, dwpe, dout), written=(0, 1))
    T, C = dout.shape[1:]
    # each position's gradient goes to its token's row (repeated tokens add up)
    np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))
    # each position row gets the sum over the batch
    dwpe[:T] += dout.sum(axis=0)


# ---- Numba kernels ------------------------------------------------------------------------------
@cuda.jit
def encoder_forward_kernel(out, inp, wte, wpe):
    """out: (B,T,C); inp: (B,T); wte: (Vp,C); wpe: (maxT,C). One thread per (b,t,c). Overwrites out."""
    B, T, C = out.shape
    i = cuda.grid(1)
    if i < B * T * C:
        b = i // (T * C)
        t = (i // C) % T
        c = i % C
        store(out, (b, t, c), load(wte, (inp[b, t], c)) + load(wpe, (t, c)))


@cuda.jit
def encoder_backward_wpe_kernel(dwpe, dout):
    """dwpe: (maxT,C); dout: (B,T,C). One thread per (t,c), summing over b in order. Accumulates (+=) into dwpe."""
    B, T, C = dout.shape
    i = cuda.grid(1)
    if i < T * C:
        t = i // C
        c = i % C
        acc = np.float64(0.0)
        for b in range(B):
            acc += load(dout, (b, t, c))
        store_add(dwpe, (t, c), acc)


@cuda.jit
def encoder_backward_wte_kernel(dwte, dout, inp):
    """dwte: (Vp,C); dout: (B,T,C); inp: (B,T). One thread per channel c owns column c of dwte and visits
    every (b,t) in order, so repeated tokens add up without atomics. Accumulates (+=) into dwte."""
    B, T, C = dout.shape
    c = cuda.grid(1)
    if c < C:
        for b in range(B):
            for t in range(T):
                store_add(dwte, (inp[b, t], c), load(dout, (b, t, c)))


# ---- the layer: the kernels' launches -----------------------------------------------------------
def encoder_forward(dev, out, inp, wte, wpe) -> None:
    """out: (B,T,C); inp: (B,T) int32; wte: (Vp,C); wpe: (maxT,C). Overwrites out."""
    dev.launch(encoder_forward_kernel, ceil_div(out.size, dev.block_size), dev.block_size, out, inp, wte, wpe)


def encoder_backward(dev, dwte, dwpe, dout, inp, buckets=None) -> None:
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T) int32. Accumulates (+=) into dwte, dwpe.
    buckets: the fast set's positions sorted by token (llmz.fast.encoder); the teaching wte kernel walks the
    positions itself and does not need them."""
    _, T, C = dout.shape
    bs = dev.block_size
    dev.launch(encoder_backward_wpe_kernel, ceil_div(T * C, bs), bs, dwpe, dout)
    dev.launch(encoder_backward_wte_kernel, ceil_div(C, bs), bs, dwte, dout, inp)
