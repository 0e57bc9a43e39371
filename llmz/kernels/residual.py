"""The residual connection (llm.c: residual_forward / residual_backward):

    out = inp1 + inp2;   backward: dinp1 += dout, dinp2 += dout (the gradient passes to both unchanged)

Arrays: any shape, the same size; float32, float64 or uint16 (bf16 bits, added in float32, results rounded
to nearest), read and written through llmz.kernels.bf16's load / store. One thread per element.
residual_forward overwrites out; residual_backward accumulates (+=) into dinp1 and dinp2.
"""
from numba import cuda

from ..bf16 import is_bf16, run_in_f32
from .bf16 import load, store


# ---- NumPy reference ----------------------------------------------------------------------------
def residual_forward_ref(out, inp1, inp2):
    """out, inp1, inp2: any shape, same size. Overwrites out."""
    if is_bf16(out) or is_bf16(inp1) or is_bf16(inp2):
        return run_in_f32(residual_forward_ref, (out, inp1, inp2), written=(0,))
    out[...] = inp1 + inp2


def residual_backward_ref(dinp1, dinp2, dout):
    """dinp1, dinp2, dout: any shape, same size; dinp1 and dinp2 are two different arrays. Accumulates (+=)
    into dinp1 and dinp2."""
    if is_bf16(dinp1) or is_bf16(dinp2) or is_bf16(dout):
        return run_in_f32(residual_backward_ref, (dinp1, dinp2, dout), written=(0, 1))
    dinp1 += dout
    dinp2 += dout


# ---- Numba kernels: one thread per element --------------------------------------------------------
@cuda.jit
def residual_forward_kernel(out, inp1, inp2, n):
    """out, inp1, inp2: (n,). Overwrites out."""
    i = cuda.grid(1)
    if i < n:
        store(out, i, load(inp1, i) + load(inp2, i))


@cuda.jit
def residual_backward_kernel(dinp1, dinp2, dout, n):
    """dinp1, dinp2, dout: (n,), dinp1 and dinp2 different arrays. Accumulates (+=) into both."""
    i = cuda.grid(1)
    if i < n:
        d = load(dout, i)
        store(dinp1, i, load(dinp1, i) + d)
        store(dinp2, i, load(dinp2, i) + d)


# ---- the layer: the kernel's launch -------------------------------------------------------------
def residual_forward(dev, out, inp1, inp2) -> None:
    """out = inp1 + inp2 (any shape). Overwrites out."""
    dev.launch_per_element(residual_forward_kernel, (out, inp1, inp2))


def residual_backward(dev, dinp1, dinp2, dout) -> None:
    """dinp1 += dout; dinp2 += dout (dinp1, dinp2: two different arrays). Accumulates."""
    dev.launch_per_element(residual_backward_kernel, (dinp1, dinp2, dout))
