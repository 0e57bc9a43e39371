"""The encoder: token embedding plus position embedding.

    out[b,t,:] = wte[inp[b,t], :] + wpe[t, :]
    backward: dwte[inp[b,t], :] += dout[b,t,:],   dwpe[t, :] += sum_b dout[b,t,:]

Kernels (the teaching versions, deterministic: no float atomics):
  forward       one thread per (b,t,c)
  backward wpe  one thread per (t,c), summing over b in order
  backward wte  one thread per channel c, looping over all (b,t) in order. Only C threads, so slow: it is
                llm.c's dev/cuda/encoder_backward.cu version 2. llm.c's train_gpt2.cu (llmc/encoder.cuh) is
                fast and still deterministic by sorting the (b,t) positions into buckets by token id first.
"""
import numpy as np
from numba import cuda

from ..device import ceil_div


# ---- NumPy reference ----------------------------------------------------------------------------
def encoder_forward_ref(out, inp, wte, wpe):
    """out: (B,T,C); inp: (B,T) int token ids; wte: (Vp,C); wpe: (maxT,C), T <= maxT. Overwrites out."""
    T = inp.shape[1]
    # token row plus position row
    out[...] = wte[inp] + wpe[:T]


def encoder_backward_ref(dwte, dwpe, dout, inp):
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T). Accumulates (+=) into dwte, dwpe."""
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
        out[b, t, c] = wte[inp[b, t], c] + wpe[t, c]


@cuda.jit
def encoder_backward_wpe_kernel(dwpe, dout):
    """dwpe: (maxT,C); dout: (B,T,C). One thread per (t,c), summing over b in order. Accumulates (+=) into dwpe."""
    B, T, C = dout.shape
    i = cuda.grid(1)
    if i < T * C:
        t = i // C
        c = i % C
        acc = 0.0
        for b in range(B):
            acc += dout[b, t, c]
        dwpe[t, c] += acc


@cuda.jit
def encoder_backward_wte_kernel(dwte, dout, inp):
    """dwte: (Vp,C); dout: (B,T,C); inp: (B,T). One thread per channel c owns column c of dwte and visits
    every (b,t) in order, so repeated tokens add up without atomics. Accumulates (+=) into dwte."""
    B, T, C = dout.shape
    c = cuda.grid(1)
    if c < C:
        for b in range(B):
            for t in range(T):
                dwte[inp[b, t], c] += dout[b, t, c]


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def encoder_forward(dev, out, inp, wte, wpe) -> None:
    """out: (B,T,C); inp: (B,T) int32; wte: (Vp,C); wpe: (maxT,C). Overwrites out."""
    if not dev.kernels:
        return encoder_forward_ref(out, inp, wte, wpe)
    dev.launch(encoder_forward_kernel, ceil_div(out.size, dev.block_size), dev.block_size, out, inp, wte, wpe)


def encoder_backward(dev, dwte, dwpe, dout, inp) -> None:
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T) int32. Accumulates (+=) into dwte, dwpe."""
    if not dev.kernels:
        return encoder_backward_ref(dwte, dwpe, dout, inp)
    T, C = dout.shape[1:]
    bs = dev.block_size
    dev.launch(encoder_backward_wpe_kernel, ceil_div(T * C, bs), bs, dwpe, dout)
    dev.launch(encoder_backward_wte_kernel, ceil_div(C, bs), bs, dwte, dout, inp)
