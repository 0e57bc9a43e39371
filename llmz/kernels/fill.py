"""Fill a buffer with a constant: the zeroing of gradient and scratch buffers before backward accumulates.

A kernel rather than `x[...] = 0` so that on the GPU it runs on the compute stream, in order with the
layers, with no host synchronisation. One thread per element; x any shape, float32, float64 or uint16 (bf16
bits: filled with the bits of value rounded to nearest bf16), written through llmz.kernels.bf16's store.
Overwrites x.
"""
import numpy as np
from numba import cuda

from ..bf16 import f32_to_bf16, is_bf16
from .bf16 import store


def fill_ref(x, value):
    """x: any shape. Overwrites every element with value (uint16: value's bf16 bits)."""
    x[...] = f32_to_bf16(np.float32(value)) if is_bf16(x) else value


@cuda.jit
def fill_kernel(x, n, value):
    """x: (n,). One thread per element. Overwrites x[i] with value."""
    i = cuda.grid(1)
    if i < n:
        store(x, i, value)


def fill(dev, x, value=0.0, stream=None) -> None:
    """x = value everywhere, on the compute stream (or `stream`). Overwrites x."""
    if x.size:
        dev.launch_per_element(fill_kernel, (x,), value, stream=stream)


def zero(dev, x, stream=None) -> None:
    """x = 0 (fill_kernel with 0.0). Overwrites x."""
    fill(dev, x, 0.0, stream=stream)
