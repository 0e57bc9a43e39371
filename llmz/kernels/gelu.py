"""GELU, the tanh approximation GPT-2 uses (llm.c: gelu_forward / gelu_backward):

    gelu(x)  = 0.5 x (1 + tanh u),   u = s (x + 0.044715 x^3),   s = sqrt(2/pi)
    gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) s (1 + 3 * 0.044715 x^2)

inp, out, dinp, dout: any shape, the same size; float32, float64 or uint16 (bf16 bits, computed in float32,
results rounded to nearest), read and written through llmz.kernels.bf16's load / store. One thread per
element. gelu_forward overwrites out. gelu_backward accumulates (+=) into dinp; accumulate=False overwrites
dinp without reading it (the caller need not zero it first).
"""
import math

import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store

GELU_SCALE = math.sqrt(2.0 / math.pi)
# the kernels' constants in the inputs' precision: a float64 constant would turn every float32 element's
# arithmetic (tanh included) into float64, which runs at a fraction of the float32 rate
S32, C32, HALF, ONE = np.float32(GELU_SCALE), np.float32(0.044715), np.float32(0.5), np.float32(1.0)
THREE_C32 = np.float32(3.0 * 0.044715)


# ---- NumPy reference ----------------------------------------------------------------------------
def gelu_forward_ref(out, inp):
    """out, inp: any shape, same size. Overwrites out."""
    if is_bf16(out) or is_bf16(inp):
        return run_in_f32(gelu_forward_ref, (out, inp), written=(0,))
    x = inp
    out[...] = 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + 0.044715 * (x * x * x))))   # x*x*x: np.power is slow


def gelu_backward_ref(dinp, inp, dout, accumulate: bool = True):
    """dinp += gelu'(inp) * dout: accumulates into dinp; accumulate=False overwrites dinp (never read)."""
    if is_bf16(dinp) or is_bf16(inp) or is_bf16(dout):
        def ref(dinp, inp, dout):
            gelu_backward_ref(dinp, inp, dout, accumulate)
        return run_in_f32(ref, (dinp, inp, dout), written=(0,))
    x = inp
    u = GELU_SCALE * (x + 0.044715 * (x * x * x))
    t = np.tanh(u)
    local = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x)
    if accumulate:
        dinp += local * dout
    else:
        dinp[...] = local * dout


# ---- Numba kernels: one thread per element --------------------------------------------------------
@cuda.jit(device=True)
def gelu_value(x):
    """gelu(x) in x's precision (float32 for float32 and bf16 storage)."""
    return HALF * x * (ONE + math.tanh(S32 * (x + C32 * x * x * x)))


@cuda.jit(device=True)
def gelu_grad(x):
    """gelu'(x) in x's precision."""
    t = math.tanh(S32 * (x + C32 * x * x * x))
    return HALF * (ONE + t) + HALF * x * (ONE - t * t) * S32 * (ONE + THREE_C32 * x * x)


@cuda.jit
def gelu_forward_kernel(out, inp, n):
    """out, inp: (n,). Overwrites out."""
    i = cuda.grid(1)
    if i < n:
        store(out, i, gelu_value(load(inp, i)))


@cuda.jit
def gelu_backward_kernel(dinp, inp, dout, n, accumulate):
    """dinp, inp, dout: (n,). Accumulates (+=) into dinp, or overwrites it (not read) when accumulate is False."""
    i = cuda.grid(1)
    if i < n:
        d = gelu_grad(load(inp, i)) * load(dout, i)
        store(dinp, i, load(dinp, i) + d if accumulate else d)


# ---- the layer: the kernel's launch -------------------------------------------------------------
def gelu_forward(dev, out, inp) -> None:
    """out = gelu(inp), any shape. Overwrites out."""
    dev.launch_per_element(gelu_forward_kernel, (out, inp))


def gelu_backward(dev, dinp, inp, dout, accumulate: bool = True) -> None:
    """dinp += gelu'(inp) * dout (accumulates), or dinp = gelu'(inp) * dout (accumulate=False: overwrites,
    dinp not read)."""
    dev.launch_per_element(gelu_backward_kernel, (dinp, inp, dout), accumulate)
