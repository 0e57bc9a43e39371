"""The residual connection: out = inp1 + inp2; backward passes dout to both inputs unchanged."""
from numba import cuda

from ..device import ceil_div


# ---- NumPy reference ----------------------------------------------------------------------------
def residual_forward_ref(out, inp1, inp2):
    """out, inp1, inp2: any shape, same size. Overwrites out."""
    out[...] = inp1 + inp2


def residual_backward_ref(dinp1, dinp2, dout):
    """dinp1, dinp2, dout: any shape, same size. Accumulates (+=) into dinp1 and dinp2."""
    dinp1 += dout
    dinp2 += dout


# ---- Numba kernels: one thread per element ------------------------------------------------------
@cuda.jit
def residual_forward_kernel(out, inp1, inp2, n):
    i = cuda.grid(1)
    if i < n:
        out[i] = inp1[i] + inp2[i]


@cuda.jit
def residual_backward_kernel(dinp1, dinp2, dout, n):
    i = cuda.grid(1)
    if i < n:
        dinp1[i] += dout[i]
        dinp2[i] += dout[i]


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def residual_forward(dev, out, inp1, inp2) -> None:
    """out = inp1 + inp2 (any shape). Overwrites out."""
    if not dev.kernels:
        return residual_forward_ref(out, inp1, inp2)
    n = out.size
    dev.launch(residual_forward_kernel, ceil_div(n, dev.block_size), dev.block_size,
               out.reshape(-1), inp1.reshape(-1), inp2.reshape(-1), n)


def residual_backward(dev, dinp1, dinp2, dout) -> None:
    """dinp1 += dout; dinp2 += dout. Accumulates."""
    if not dev.kernels:
        return residual_backward_ref(dinp1, dinp2, dout)
    n = dout.size
    dev.launch(residual_backward_kernel, ceil_div(n, dev.block_size), dev.block_size,
               dinp1.reshape(-1), dinp2.reshape(-1), dout.reshape(-1), n)
