"""GELU's fast kernels. The math, shapes and dtypes are llmz/kernels/gelu.py's.

gelu_forward_units_kernel and gelu_backward_units_kernel replace the teaching gelu_forward_kernel and
gelu_backward_kernel (one thread per element) for float32 and bf16 arrays of a size % 8 == 0 starting on 16
bytes (units_fit): two units of 8 elements a thread (llmz.fast.vectors: 16-byte loads and stores), every
load issued before any math. Other arrays take the teaching kernels.

The arithmetic: 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)) = sig, so (1 - sig = exp(-2u) sig)
    gelu(x) = x sig,    gelu'(x) = sig + 2 x exp(-2u) sig^2 s (1 + 3 * 0.044715 x^2)
with exp and the reciprocal as the multi-function unit's ex2.approx and rcp.approx (~2 float32 ulps each).
The teaching kernels' libdevice tanhf is ~25 instructions: in bf16 (4 or 6 bytes an element) they made the
kernels compute-bound at a third of the memory's rate.
Contract: float32 results within 1e-6 relative (normwise) of the float64 reference (the teaching kernels:
within 1e-7); bf16 results within one bf16 step of the teaching kernels' (the same where the float32 value
is not near a rounding boundary). gelu_backward accumulates (+=) into dinp, or overwrites it without reading
it (accumulate=False), as the teaching one does.
"""
import math

import numpy as np
from numba import cuda

from ..kernels import gelu as teaching
from ..kernels.gelu import C32, ONE, S32, THREE_C32
from .device_helpers import loads_barrier
from .vectors import (
    LOG2E,
    UNIT,
    exp2_approx,
    launch_units,
    load_slots,
    rcp_approx,
    store_slots,
    two_slots,
)

MINUS_2LOG2E = np.float32(-2.0) * LOG2E
EXP2_CAP = np.float32(120.0)
TWO_S32 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
VALUES = 2 * UNIT           # the values of a thread's two units


@cuda.jit(device=True)
def gelu_sig(x):
    """(sig, e): e = exp(-2u), u = s (x + 0.044715 x^3), and sig = 0.5 (1 + tanh u) = 1 / (1 + e), float32.
    e is capped at 2^120 (u < -41.6: gelu and gelu' are below 1e-34 there): e sig stays finite, never inf * 0."""
    e = exp2_approx(min(MINUS_2LOG2E * (S32 * (x + C32 * x * x * x)), EXP2_CAP))
    return rcp_approx(ONE + e), e


@cuda.jit(device=True)
def gelu_fast(x):
    """gelu(x) = x sig."""
    sig, _ = gelu_sig(x)
    return x * sig


@cuda.jit(device=True)
def gelu_grad_fast(x):
    """gelu'(x) = sig + 2 x sig (1 - sig) s (1 + 3 * 0.044715 x^2), with 1 - sig = e sig (no cancellation
    where sig is near 1)."""
    sig, e = gelu_sig(x)
    return sig + TWO_S32 * x * (e * sig) * sig * (ONE + THREE_C32 * x * x)


# ---- Numba kernels: two units of 8 elements a thread ---------------------------------------------------
@cuda.jit
def gelu_forward_units_kernel(out, inp, n_units):
    """out, inp: (8 n_units,). Overwrites out."""
    i0, i1, e0, e1 = two_slots(n_units)
    x = cuda.local.array(VALUES, np.float32)
    load_slots(x, inp, e0, e1)
    loads_barrier()
    for k in range(VALUES):
        x[k] = gelu_fast(x[k])
    store_slots(out, x, i0, i1, e0, e1, n_units)


@cuda.jit
def gelu_backward_units_kernel(dinp, inp, dout, n_units, accumulate):
    """dinp, inp, dout: (8 n_units,). Accumulates (+=) into dinp, or overwrites it (dinp not read) when
    accumulate is False."""
    i0, i1, e0, e1 = two_slots(n_units)
    x = cuda.local.array(VALUES, np.float32)
    g = cuda.local.array(VALUES, np.float32)
    d = cuda.local.array(VALUES, np.float32)
    load_slots(x, inp, e0, e1)
    load_slots(g, dout, e0, e1)
    if accumulate:
        load_slots(d, dinp, e0, e1)
    loads_barrier()
    for k in range(VALUES):
        v = gelu_grad_fast(x[k]) * g[k]
        d[k] = d[k] + v if accumulate else v
    store_slots(dinp, d, i0, i1, e0, e1, n_units)


# ---- the layer ---------------------------------------------------------------------------------
def gelu_forward(dev, out, inp) -> None:
    """out = gelu(inp), any shape. Overwrites out."""
    launch_units(dev, gelu_forward_units_kernel, teaching.gelu_forward, (out, inp))


def gelu_backward(dev, dinp, inp, dout, accumulate: bool = True) -> None:
    """dinp += gelu'(inp) * dout (accumulates), or dinp = gelu'(inp) * dout (accumulate=False: overwrites,
    dinp not read)."""
    launch_units(dev, gelu_backward_units_kernel, teaching.gelu_backward, (dinp, inp, dout), bool(accumulate))
