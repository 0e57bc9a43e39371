"""GELU, version by version (llm.c's dev/cuda role): forward and backward (overwriting dinp, as the model
calls it), each version checked against the float64 reference on fresh random bf16 inputs and timed at the
MLP's (B*T, 4C) of d12..d48, a table last (dev/harness.py).

    python dev/gelu.py [--model d48] [-b 8] [VERSION ...]

version 1: the teaching kernels (llmz.kernels.gelu): one thread per element, libdevice tanhf
version 2: words of two elements, four a thread (dev/pairs.py): bound by tanhf's ~25 instructions in bf16
version 3: llmz.fast.gelu: units of 8 (16-byte loads), two a thread; 0.5 (1 + tanh u) = 1 / (1 + exp(-2u))
           on the multi-function unit (ex2.approx, rcp.approx)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness, pairs
from llmz.fast import gelu as fast
from llmz.kernels import gelu as teaching
from llmz.kernels.gelu import gelu_backward_ref, gelu_forward_ref


def forward_with(fn):
    return lambda dev, d: fn(dev, d["out"], d["inp"])


def backward_with(fn):
    return lambda dev, d: fn(dev, d["dinp"], d["inp"], d["dout"], False)


CASES = {
    "forward": {1: forward_with(teaching.gelu_forward),
                2: lambda dev, d: pairs.launch_pairs(dev, pairs.gelu_forward_pairs_kernel, (d["out"], d["inp"])),
                3: forward_with(fast.gelu_forward)},
    "backward": {1: backward_with(teaching.gelu_backward),
                 2: lambda dev, d: pairs.launch_pairs(dev, pairs.gelu_backward_pairs_kernel,
                                                      (d["dinp"], d["inp"], d["dout"]), False),
                 3: backward_with(fast.gelu_backward)},
}
NAMES = {1: "teaching", 2: "words of two, tanhf", 3: "units, ex2/rcp approx"}
VERSIONS = {v: (NAMES[v], lambda dev, d, case, v=v: CASES[case][v](dev, d)) for v in NAMES}


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
