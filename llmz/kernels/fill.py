"""Fill a buffer with a constant (the zeroing of gradient and scratch buffers before backward accumulates).

A kernel rather than `x[...] = 0` so that on the GPU it runs on the compute stream, in order with the
layers, with no host synchronisation.
"""
from numba import cuda

from ..device import ceil_div


def fill_ref(x, value):
    """x: any shape. Overwrites every element with value."""
    x[...] = value


@cuda.jit
def fill_kernel(x, value, n):
    i = cuda.grid(1)
    if i < n:
        x[i] = value


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
