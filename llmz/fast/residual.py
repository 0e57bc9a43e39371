"""The residual connection's fast kernels. The math, shapes and dtypes are llmz/kernels/residual.py's.

residual_forward_units_kernel and residual_backward_units_kernel replace the teaching residual_forward_kernel
and residual_backward_kernel (one thread per element) for float32 and bf16 arrays of a size % 8 == 0 starting
on 16 bytes (units_fit): two units of 8 elements a thread (llmz.fast.vectors, as llmz.fast.gelu), every load
issued before any store. Other arrays take the teaching kernels. (The forward fused into the next layernorm
is llmz.fast.layernorm.residual_layernorm_forward.)
Contract: the same bits as the teaching kernels (the same float32 add per element, one rounding).
residual_forward overwrites out; residual_backward accumulates (+=) into dinp1 and dinp2.
"""
import numpy as np
from numba import cuda

from ..kernels import residual as teaching
from .device_helpers import loads_barrier
from .vectors import UNIT, add_store_slots, launch_units, load_slots, store_slots, two_slots

VALUES = 2 * UNIT           # the values of a thread's two units


# ---- Numba kernels: two units of 8 elements a thread ---------------------------------------------------
@cuda.jit
def residual_forward_units_kernel(out, inp1, inp2, n_units):
    """out, inp1, inp2: (8 n_units,). Overwrites out."""
    i0, i1, e0, e1 = two_slots(n_units)
    a = cuda.local.array(VALUES, np.float32)
    b = cuda.local.array(VALUES, np.float32)
    load_slots(a, inp1, e0, e1)
    load_slots(b, inp2, e0, e1)
    loads_barrier()
    add_store_slots(out, a, b, i0, i1, e0, e1, n_units)


@cuda.jit
def residual_backward_units_kernel(dinp1, dinp2, dout, n_units):
    """dinp1, dinp2, dout: (8 n_units,), dinp1 and dinp2 different arrays. Accumulates (+=) into both."""
    i0, i1, e0, e1 = two_slots(n_units)
    g = cuda.local.array(VALUES, np.float32)
    load_slots(g, dout, e0, e1)
    # the two gradients added to, read with dout before any add
    p = cuda.local.array(VALUES, np.float32)
    load_slots(p, dinp1, e0, e1)
    q = cuda.local.array(VALUES, np.float32)
    load_slots(q, dinp2, e0, e1)
    loads_barrier()
    for k in range(VALUES):
        p[k] += g[k]
        q[k] += g[k]
    store_slots(dinp1, p, i0, i1, e0, e1, n_units)
    store_slots(dinp2, q, i0, i1, e0, e1, n_units)


# ---- the layer ---------------------------------------------------------------------------------
def residual_forward(dev, out, inp1, inp2) -> None:
    """out = inp1 + inp2 (any shape). Overwrites out."""
    launch_units(dev, residual_forward_units_kernel, teaching.residual_forward, (out, inp1, inp2))


def residual_backward(dev, dinp1, dinp2, dout) -> None:
    """dinp1 += dout; dinp2 += dout (dinp1, dinp2: two different arrays). Accumulates."""
    launch_units(dev, residual_backward_units_kernel, teaching.residual_backward, (dinp1, dinp2, dout))
