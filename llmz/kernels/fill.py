"""Fill a buffer with a constant (the zeroing of gradient and scratch buffers before backward accumulates).

A kernel rather than `x[...] = 0` so that on the GPU it runs on the compute stream, in order with the
layers, with no host synchronisation.

x may be float32, float64 or uint16 (bf16 bits: filled with the bits of value rounded to nearest bf16),
written through llmz.kernels.bf16's store.
"""
import numpy as np
from numba import cuda

from ..bf16 import f32_to_bf16, is_bf16
from ..device import ceil_div
from .bf16 import store


def fill_ref(x, value):
    """x: any shape. Overwrites every element with value (uint16: value's bf16 bits)."""
    x[...] = f32_to_bf16(np.float32(value)) if is_bf16(x) else value


@cuda.jit
def fill_kernel(x, value, n):
    # x (n,). Overwrites x[i] with value.
    i = cuda.grid(1)
    if i < n:
        store(x, i, value)


def fill(dev, x, value=0.0, stream=None):
    if not dev.kernels:
        return fill_ref(x, value)
    n = x.size
    if n == 0:
        return
    dev.launch(fill_kernel, ceil_div(n, dev.block_size), dev.block_size, x.reshape(-1), value, n,
               stream=stream)


def zero(dev, x, stream=None):
    """x = 0. On the GPU a memset (cudaMemsetAsync: all-zero bits are 0.0) on the compute stream or
    `stream`; capturable into a CUDA graph like a kernel."""
    if dev.kind == "gpu" and x.flags.c_contiguous:
        with dev.region("memset", nbytes=x.nbytes, stream=stream):
            x.data.memset_async(0, x.nbytes, (stream or dev.compute_stream).cupy)
        return
    fill(dev, x, 0.0, stream=stream)
