"""GELU, version by version (llm.c's dev/cuda role): forward and backward (overwriting dinp, as the model
calls it), each version checked against the float64 reference on fresh random bf16 inputs and timed at the
MLP's (B*T, 4C) of d12..d48, a table last (dev/harness.py).

    python dev/gelu.py [--model d48] [-b 8] [VERSION ...]

version 1: teaching (llmz.kernels.gelu): a thread an element, libdevice tanhf
version 2: fast set (llmz.fast.gelu): words of two, four a thread; tanhf-bound in bf16 (d48 bwd: 246 us, 27%)
version 3: units of 8, exp/rcp on ex2/rcp.approx; predicts d48 fwd 57, bwd 86 us (85%); not yet run on a GPU
"""
import math
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.vectors import LOG2E, UNIT, exp2_approx, launch_units, load_slots, rcp_approx, store_slots, two_slots
from llmz.fast import gelu as fast
from llmz.fast.device_helpers import loads_barrier
from llmz.kernels import gelu as teaching
from llmz.kernels.gelu import C32, ONE, S32, THREE_C32, gelu_backward_ref, gelu_forward_ref

# ---- version 3: units, exp and the reciprocal on the multi-function unit -----------------------------------
# gelu(x) = x sig, gelu'(x) = sig + 2 x exp(-2u) sig^2 s (1 + 3 * 0.044715 x^2), sig = 1 / (1 + exp(-2u)) (so
# 1 - sig = exp(-2u) sig: no cancellation where sig is near 1). Contract: float32 within 1e-6 relative
# (normwise) of float64; bf16 within one bf16 step of the teaching kernels.
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
    """gelu'(x) = sig + 2 x sig (1 - sig) s (1 + 3 * 0.044715 x^2), with 1 - sig = e sig."""
    sig, e = gelu_sig(x)
    return sig + TWO_S32 * x * (e * sig) * sig * (ONE + THREE_C32 * x * x)


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


def gelu_forward_units(dev, out, inp) -> None:
    """llmz.fast.gelu.gelu_forward's call on units (the teaching kernel where units do not fit)."""
    launch_units(dev, gelu_forward_units_kernel, teaching.gelu_forward, (out, inp))


def gelu_backward_units(dev, dinp, inp, dout, accumulate: bool = True) -> None:
    """llmz.fast.gelu.gelu_backward's call on units (the teaching kernel where units do not fit)."""
    launch_units(dev, gelu_backward_units_kernel, teaching.gelu_backward, (dinp, inp, dout), bool(accumulate))


# ---- the versions of each case --------------------------------------------------------------------------
FORWARD = {1: teaching.gelu_forward, 2: fast.gelu_forward, 3: gelu_forward_units}
BACKWARD = {1: teaching.gelu_backward, 2: fast.gelu_backward, 3: gelu_backward_units}
NAMES = {1: "teaching", 2: "words of two, tanhf (fast set)", 3: "units, ex2/rcp approx (candidate)"}
# each version's layer functions, called as the model calls them (the backward overwriting dinp)
CASES = {"forward": {v: (lambda dev, d, fn=fn: fn(dev, d["out"], d["inp"])) for v, fn in FORWARD.items()},
         "backward": {v: (lambda dev, d, fn=fn: fn(dev, d["dinp"], d["inp"], d["dout"], False))
                      for v, fn in BACKWARD.items()}}
VERSIONS = harness.case_versions(NAMES, CASES)


def cases(cfg, B):
    import cupy as cp
    shape = (B * harness.T, 4 * cfg.channels)
    n = shape[0] * shape[1]

    def make():
        return {"inp": harness.rand(shape, 2.0), "dout": harness.rand(shape), "out": cp.zeros(shape, cp.uint16),
                "dinp": cp.zeros(shape, cp.uint16)}

    def forward_ref(d):
        out = cp.empty(shape)
        gelu_forward_ref(out, harness.f64(d["inp"]))
        return {"out": out}

    def backward_ref(d):
        dinp = cp.empty(shape)
        gelu_backward_ref(dinp, harness.f64(d["inp"]), harness.f64(d["dout"]), accumulate=False)
        return {"dinp": dinp}
    yield "forward", make, ("out",), forward_ref, 4 * n, harness.BF16_TOL, lambda v: True
    yield "backward", make, ("dinp",), backward_ref, 6 * n, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("gelu", __doc__, VERSIONS, cases, sys.argv[1:]))
