"""Zeroing, fast: replaces llmz/kernels/fill.py's zero (fill_kernel writing 0.0, one thread per element) for a
C-contiguous buffer with one memset (dev.memset_zero: cudaMemsetAsync on the GPU, on the compute stream or
the given one, capturable into a CUDA graph like a kernel). Other buffers take the teaching kernel, and fill
(any value) is the teaching one.
Contract: the same bits (all-zero bits are +0.0 in float32, float64 and bf16). Overwrites x.
"""
from ..kernels.fill import fill
from ..kernels.fill import zero as teaching_zero

__all__ = ["fill", "zero"]


def zero(dev, x, stream=None) -> None:
    """x = 0. Overwrites x."""
    if not x.flags.c_contiguous:
        return teaching_zero(dev, x, stream)
    dev.memset_zero(x, stream)
