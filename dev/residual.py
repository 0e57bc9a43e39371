"""The residual connection, version by version (llm.c's dev/cuda role): forward and backward, each version
checked against the float64 reference on fresh random bf16 inputs and timed at (B*T, C) of d12..d48, a table
last (dev/harness.py). (The forward fused into the next layernorm: dev/layernorm.py's residual case.)

    python dev/residual.py [--model d48] [-b 8] [VERSION ...]

version 1: the teaching kernels (llmz.kernels.residual): one thread per element
version 2: words of two elements, four a thread (dev/pairs.py)
version 3: llmz.fast.residual: units of 8 (16-byte loads), two a thread
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness, pairs
from llmz.fast import residual as fast
from llmz.kernels import residual as teaching


def forward_with(fn):
    return lambda dev, d: fn(dev, d["out"], d["inp1"], d["inp2"])


def backward_with(fn):
    return lambda dev, d: fn(dev, d["dinp1"], d["dinp2"], d["dout"])


CASES = {
    "forward": {1: forward_with(teaching.residual_forward),
                2: lambda dev, d: pairs.launch_pairs(dev, pairs.residual_forward_pairs_kernel,
                                                     (d["out"], d["inp1"], d["inp2"])),
                3: forward_with(fast.residual_forward)},
    "backward": {1: backward_with(teaching.residual_backward),
                 2: lambda dev, d: pairs.launch_pairs(dev, pairs.residual_backward_pairs_kernel,
                                                      (d["dinp1"], d["dinp2"], d["dout"])),
                 3: backward_with(fast.residual_backward)},
}
NAMES = {1: "teaching", 2: "words of two", 3: "units of 8"}
VERSIONS = {v: (NAMES[v], lambda dev, d, case, v=v: CASES[case][v](dev, d)) for v in NAMES}


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
