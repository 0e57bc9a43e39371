"""The residual connection, version by version (llm.c's dev/cuda role): forward and backward, each version
checked against the float64 reference on fresh random bf16 inputs and timed at (B*T, C) of d12..d48, a table
last (dev/harness.py). (The forward fused into the next layernorm: dev/layernorm.py's residual case.)

    python dev/residual.py [--model d48] [-b 8] [VERSION ...]

version 1: teaching (llmz.kernels.residual): a thread an element
version 2: fast set (llmz.fast.residual): words of two elements, four a thread
version 3: units of 8, two a thread (teaching bits); predicts d48 fwd 21, bwd 36 us; not yet run on a GPU
"""
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.vectors import UNIT, add_store_slots, launch_units, load_slots, store_slots, two_slots
from llmz.fast import residual as fast
from llmz.fast.device_helpers import loads_barrier
from llmz.kernels import residual as teaching

# ---- version 3: two units of 8 elements a thread (contract: the teaching kernels' bits) ------------------
VALUES = 2 * UNIT           # the values of a thread's two units


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


def residual_forward_units(dev, out, inp1, inp2) -> None:
    """llmz.fast.residual.residual_forward's call on units (the teaching kernel where units do not fit)."""
    launch_units(dev, residual_forward_units_kernel, teaching.residual_forward, (out, inp1, inp2))


def residual_backward_units(dev, dinp1, dinp2, dout) -> None:
    """llmz.fast.residual.residual_backward's call on units (the teaching kernel where units do not fit)."""
    launch_units(dev, residual_backward_units_kernel, teaching.residual_backward, (dinp1, dinp2, dout))


# ---- the versions of each case --------------------------------------------------------------------------
FORWARD = {1: teaching.residual_forward, 2: fast.residual_forward, 3: residual_forward_units}
BACKWARD = {1: teaching.residual_backward, 2: fast.residual_backward, 3: residual_backward_units}
NAMES = {1: "teaching", 2: "words of two (fast set)", 3: "units of 8 (candidate)"}
# each version's layer functions, called as the model calls them
CASES = {"forward": {v: (lambda dev, d, fn=fn: fn(dev, d["out"], d["inp1"], d["inp2"]))
                     for v, fn in FORWARD.items()},
         "backward": {v: (lambda dev, d, fn=fn: fn(dev, d["dinp1"], d["dinp2"], d["dout"]))
                      for v, fn in BACKWARD.items()}}
VERSIONS = harness.case_versions(NAMES, CASES)


def cases(cfg, B):
    import cupy as cp
    shape = (B * harness.T, cfg.channels)
    n = shape[0] * shape[1]

    def make():
        return {"inp1": harness.rand(shape), "inp2": harness.rand(shape), "dout": harness.rand(shape),
                "dinp1": harness.rand(shape), "dinp2": harness.rand(shape), "out": cp.zeros(shape, cp.uint16)}

    def forward_ref(d):
        return {"out": harness.f64(d["inp1"]) + harness.f64(d["inp2"])}

    def backward_ref(d):
        g = harness.f64(d["dout"])
        return {"dinp1": harness.f64(d["dinp1"]) + g, "dinp2": harness.f64(d["dinp2"]) + g}
    yield "forward", make, ("out",), forward_ref, 6 * n, harness.BF16_TOL, lambda v: True
    yield "backward", make, (), backward_ref, 10 * n, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("residual", __doc__, VERSIONS, cases, sys.argv[1:]))
