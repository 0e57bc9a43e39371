"""AdamW as llm.c does it (bias correction, decoupled weight decay), on one flat 1-D slice of parameters:

    g = grad * grad_scale                       (grad_scale: the clipping factor, 1.0 when not clipping)
    m = beta1 m + (1 - beta1) g                 v = beta2 v + (1 - beta2) g^2
    m_hat = m / (1 - beta1^t)                   v_hat = v / (1 - beta2^t)
    p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p),   wd = weight_decay for i < decay_size, 0 after

The numbers that change from step to step (lr, grad_scale, the two bias corrections) come from a small
float64 device array, `scalars` = [lr, grad_scale, 1 - beta1^t, 1 - beta2^t], not from Python floats: a
kernel launch then never changes between steps, so the whole step can be captured once as a CUDA graph and
replayed (the clipping factor is even computed on the device, by norm.clip_scale). beta1, beta2, eps and
weight_decay are fixed for a run and stay plain arguments.
"""
import math

import numpy as np
from numba import cuda

from ..device import ceil_div


# ---- NumPy reference ----------------------------------------------------------------------------
def adamw_update_ref(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay):
    """params, grads, m, v: (n,); scalars: [lr, grad_scale, 1 - beta1^t, 1 - beta2^t].
    Overwrites params, m and v. Computes in the dtype of the arrays."""
    lr, grad_scale, bc1, bc2 = (float(s) for s in scalars[:4])
    d = decay_size
    # scaled (clipped) gradient
    g = grads * grad_scale
    # moment updates
    m[...] = beta1 * m + (1.0 - beta1) * g
    v[...] = beta2 * v + (1.0 - beta2) * (g * g)
    # bias-corrected step direction
    step = (m / bc1) / (np.sqrt(v / bc2) + eps)
    # decoupled weight decay on the first decay_size elements only
    step[:d] += weight_decay * params[:d]
    params -= lr * step


# ---- Numba kernel: one thread per element --------------------------------------------------------
@cuda.jit
def adamw_kernel(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay, n):
    """Arithmetic in float64 (the scalars are float64); params, m, v rounded once when stored."""
    i = cuda.grid(1)
    if i < n:
        lr = scalars[0]
        # scaled (clipped) gradient
        g = grads[i] * scalars[1]
        # moment updates
        mi = beta1 * m[i] + (1.0 - beta1) * g
        vi = beta2 * v[i] + (1.0 - beta2) * g * g
        m[i] = mi
        v[i] = vi
        # bias-corrected step direction
        step = (mi / scalars[2]) / (math.sqrt(vi / scalars[3]) + eps)
        # decoupled weight decay on the first decay_size elements only
        p = params[i]
        wd = weight_decay if i < decay_size else 0.0
        params[i] = p - lr * (step + wd * p)


# ---- the layer: kernel on gpu/sim, reference on cpu --------------------------------------------
def adamw_update(dev, params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay):
    """params, grads, m, v: (n,); scalars: float64 device array [lr, grad_scale, 1-beta1^t, 1-beta2^t].
    Overwrites params, m and v."""
    if not dev.kernels:
        return adamw_update_ref(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay)
    n = params.size
    dev.launch(adamw_kernel, ceil_div(n, dev.block_size), dev.block_size,
               params, grads, m, v, int(decay_size), scalars,
               float(beta1), float(beta2), float(eps), float(weight_decay), n)
