"""The encoder: token embedding plus position embedding.

    out[b,t,:] = wte[inp[b,t], :] + wpe[t, :]
    backward: dwte[inp[b,t], :] += dout[b,t,:],   dwpe[t, :] += sum_b dout[b,t,:]

Kernels (the teaching versions, deterministic: no float atomics):
  forward       one thread per (b,t,c)
  backward wpe  one thread per (t,c), summing over b in order
  backward wte  one thread per channel c, looping over all (b,t) in order. Only C threads, so slow: it is
                llm.c's dev/cuda/encoder_backward.cu version 2. The default in tests and the simulator.
  backward wte, buckets (llm.c's train_gpt2.cu, llmc/encoder.cuh): the host sorts the B*T positions by token
                id (wte_buckets); one block per distinct token, threads over channels, each thread sums its
                token's positions in order in float64 and adds once into dwte[token, c]. B*T blocks instead
                of C threads walking B*T positions; still deterministic, no atomics.

The bucket table, one flat int32 array of fixed size 3*n + 2 for n = B*T positions (allocated once, refilled
every batch), U distinct tokens:
    table[0]               U
    table[1 : n+2]         run starts: token run i covers sorted[starts[i] : starts[i+1]]; starts[U] = n,
                           entries after it are n too
    table[n+2 : 2n+2]      the token id of run i (i < U), increasing; -1 after
    table[2n+2 : 3n+2]     sorted: the positions b*T+t, stably sorted by token id (ties in increasing position)

out, wte, wpe and the gradients are float32, float64 or uint16 (bf16 bits, computed in float32, results
rounded to nearest), each on its own; the kernels read and write them through llmz.kernels.bf16's load /
store / store_add. In bf16 the teaching wte kernel rounds dwte after every add (a token seen k times is
rounded k times); the bucket kernel, like llm.c's, rounds once per (token, channel).
"""
import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, store, store_add


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
        acc = 0.0
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


@cuda.jit
def encoder_backward_wte_bucket_kernel(dwte, dout, table):
    """dwte: (Vp,C); dout: (n,C), n = B*T; table: wte_buckets(inp), (3n+2,) int32. Grid (n, gy), 1-D blocks:
    block x owns token run x (blocks x >= U exit); its threads stride over the channels. Each thread sums
    its run's positions in order in float64 and adds once. Accumulates (+=) into dwte."""
    n, C = dout.shape
    run = cuda.blockIdx.x
    if run >= table[0]:
        return
    start = table[1 + run]
    end = table[2 + run]
    token = table[n + 2 + run]
    c = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    while c < C:
        # the token's positions, in increasing order
        acc = 0.0
        for k in range(start, end):
            acc += load(dout, (table[2 * n + 2 + k], c))
        store_add(dwte, (token, c), acc)
        c += cuda.gridDim.y * cuda.blockDim.x


# ---- the bucket table (host) ------------------------------------------------------------------------
def wte_table_size(n: int) -> int:
    """int32 entries of the bucket table for n = B*T positions."""
    return 3 * n + 2


def wte_buckets(inp) -> np.ndarray:
    """inp: (B,T) int host array. The bucket table (layout in the module docstring), int32 (3*B*T + 2,)."""
    tokens = np.asarray(inp).reshape(-1)
    n = tokens.size
    # positions sorted by token id; a stable sort keeps repeated tokens in increasing position
    order = np.argsort(tokens, kind="stable")
    sorted_tokens = tokens[order]
    # a run starts where the token id changes
    starts = np.flatnonzero(np.r_[True, sorted_tokens[1:] != sorted_tokens[:-1]]) if n else np.zeros(0, int)
    U = starts.size
    table = np.empty(wte_table_size(n), np.int32)
    table[0] = U
    table[1:n + 2] = n
    table[1:U + 1] = starts
    table[n + 2:2 * n + 2] = -1
    table[n + 2:n + 2 + U] = sorted_tokens[starts]
    table[2 * n + 2:] = order
    return table


def wte_buckets_upload(dev, inp, table=None):
    """inp: (B,T) int host array. Fills this device's bucket-table scratch (allocated on first use, the
    same buffer every batch of this shape) from wte_buckets(inp) (or `table`, made from inp earlier) and
    returns it, for encoder_backward."""
    table = wte_buckets(inp) if table is None else table
    buf = dev.scratch("wte_buckets", table.size, np.int32)
    dev.copy_from_host(buf, table)
    return buf


# ---- the layer: kernels on gpu/sim, reference on cpu --------------------------------------------
def encoder_forward(dev, out, inp, wte, wpe) -> None:
    """out: (B,T,C); inp: (B,T) int32; wte: (Vp,C); wpe: (maxT,C). Overwrites out."""
    if not dev.kernels:
        return encoder_forward_ref(out, inp, wte, wpe)
    dev.launch(encoder_forward_kernel, ceil_div(out.size, dev.block_size), dev.block_size, out, inp, wte, wpe)


def encoder_backward(dev, dwte, dwpe, dout, inp, buckets=None) -> None:
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T) int32; buckets: None (the teaching wte
    kernel) or the device copy of wte_buckets(inp) (the bucket kernel). Accumulates (+=) into dwte, dwpe."""
    if not dev.kernels:
        return encoder_backward_ref(dwte, dwpe, dout, inp)
    B, T, C = dout.shape
    bs = dev.block_size
    dev.launch(encoder_backward_wpe_kernel, ceil_div(T * C, bs), bs, dwpe, dout)
    if buckets is None:
        dev.launch(encoder_backward_wte_kernel, ceil_div(C, bs), bs, dwte, dout, inp)
    else:
        assert buckets.shape == (wte_table_size(B * T),), (buckets.shape, B, T)
        dev.launch(encoder_backward_wte_bucket_kernel, (B * T, ceil_div(C, bs)), bs,
                   dwte, dout.reshape(B * T, C), buckets)
