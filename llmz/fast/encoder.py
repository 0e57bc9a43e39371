"""The encoder's fast wte backward (llm.c's train_gpt2.cu, llmc/encoder.cuh). The math, shapes and dtypes are
llmz/kernels/encoder.py's.

encoder_backward_wte_bucket_kernel replaces the teaching encoder_backward_wte_kernel (one thread per channel
walking all B*T positions: only C threads): the host sorts the batch's positions by token id (wte_buckets,
built while the batch is uploaded, outside the captured step); one block per distinct token, its threads over
the channels, each thread summing its token's positions in order in float64 and adding once into
dwte[token, c]. Deterministic, no atomics. The forward and the wpe backward are the teaching kernels.
Contract: each (token, channel) gets the same terms, summed in float64 and rounded once into dwte, where the
teaching kernel rounds after each add: a token seen k times may differ by up to k roundings (float32 ulps,
or bf16 steps, of the partial sums). dwpe: the teaching kernel's bits.

The bucket table, one flat int32 array of fixed size 3*n + 2 for n = B*T positions (allocated once, refilled
every batch), U distinct tokens:
    table[0]               U
    table[1 : n+2]         run starts: token run i covers sorted[starts[i] : starts[i+1]]; starts[U] = n,
                           entries after it are n too
    table[n+2 : 2n+2]      the token id of run i (i < U), increasing; -1 after
    table[2n+2 : 3n+2]     sorted: the positions b*T+t, stably sorted by token id (ties in increasing position)
"""
import numpy as np
from numba import cuda

from ..kernels import encoder as teaching
from ..kernels.bf16 import load, store_add
from ..kernels.encoder import encoder_backward_wpe_kernel
from ..kernels.grid import ceil_div


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


# ---- the layer ---------------------------------------------------------------------------------
def encoder_backward(dev, dwte, dwpe, dout, inp, buckets=None) -> None:
    """dwte: (Vp,C); dwpe: (maxT,C); dout: (B,T,C); inp: (B,T) int32; buckets: the device copy of
    wte_buckets(inp) (None: the teaching kernels). Accumulates (+=) into dwte, dwpe."""
    if buckets is None:
        return teaching.encoder_backward(dev, dwte, dwpe, dout, inp)
    B, T, C = dout.shape
    bs = dev.block_size
    assert buckets.shape == (wte_table_size(B * T),), (buckets.shape, B, T)
    dev.launch(encoder_backward_wpe_kernel, ceil_div(T * C, bs), bs, dwpe, dout)
    dev.launch(encoder_backward_wte_bucket_kernel, (B * T, ceil_div(C, bs)), bs, dwte, dout.reshape(B * T, C), buckets)
