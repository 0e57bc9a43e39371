"""GELU, the tanh approximation GPT-2 uses:

    gelu(x) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),   s = sqrt(2/pi)
    gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) s (1 + 3 * 0.044715 x^2),   u = s (x + 0.044715 x^3)

Arrays are float32, float64 or uint16 (bf16 bits, computed in float32, results rounded to nearest): the
kernels read and write through llmz.kernels.bf16's load / store / store_add.
"""
import math

import numpy as np
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from ..device import ceil_div
from .bf16 import load, store, store_add

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


def gelu_backward_ref(dinp, inp, dout):
    """dinp += gelu'(inp) * dout. Accumulates into dinp."""
    if is_bf16(dinp) or is_bf16(inp) or is_bf16(dout):
        return run_in_f32(gelu_backward_ref, (dinp, inp, dout), written=(0,))
    x = inp
    u = GELU_SCALE * (x + 0.044715 * (x * x * x))
    t = np.tanh(u)
    local = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x)
    dinp += local * dout


# ---- Numba kernels: one thread per element ------------------------------------------------------
@cuda.jit
def gelu_forward_kernel(out, inp, n):
    i = cuda.grid(1)
    if i < n:
        x = load(inp, i)
        store(out, i, HALF * x * (ONE + math.tanh(S32 * (x + C32 * x * x * x))))


@cuda.jit
def gelu_backward_kernel(dinp, inp, dout, n):
    i = cuda.grid(1)
    if i < n:
        x = load(inp, i)
        t = math.tanh(S32 * (x + C32 * x * x * x))
        local = HALF * (ONE + t) + HALF * x * (ONE - t * t) * S32 * (ONE + THREE_C32 * x * x)
        store_add(dinp, i, local * load(dout, i))


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def gelu_forward(dev, out, inp):
    if not dev.kernels:
        return gelu_forward_ref(out, inp)
    n = inp.size
    dev.launch(gelu_forward_kernel, ceil_div(n, dev.block_size), dev.block_size,
               out.reshape(-1), inp.reshape(-1), n)


def gelu_backward(dev, dinp, inp, dout):
    if not dev.kernels:
        return gelu_backward_ref(dinp, inp, dout)
    n = inp.size
    dev.launch(gelu_backward_kernel, ceil_div(n, dev.block_size), dev.block_size,
               dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1), n)
