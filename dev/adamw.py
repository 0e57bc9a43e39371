"""AdamW for bf16 training, version by version (llm.c's dev/cuda role): one update of every parameter of
d12..d48 (bf16 params and grads, fp32 master, m, v), each version checked against the float64 reference on
fresh random inputs and timed, a table last (dev/harness.py). Bytes: 28 an element (grads 2 read, params 2
written, master, m, v 4 read + 4 written each).

    python dev/adamw.py [--model d48] [VERSION ...]

version 1: the teaching kernel (llmz.kernels.adamw): one thread per element, the update in float64
version 2: words of two elements, four a thread (dev/pairs.py), the update in float64: bound by its three
           float64 divisions, square root and seven conversions an element
version 3: llmz.fast.adamw: a unit of 8 elements a thread (16-byte loads), the update in float32
Sizes: every parameter of d12, the first 200M of the larger models.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness, pairs
from llmz.fast import adamw as fast
from llmz.kernels import adamw as teaching

BETA1, BETA2, EPS, WD, SEED = 0.9, 0.95, 1e-8, 0.1, 1234


def with_fn(fn):
    def call(dev, d, case=None):
        fn(dev, d["params"], d["master"], d["grads"], d["m"], d["v"], d["decay"].size, d["scalars"], BETA1,
           BETA2, EPS, WD, SEED)
    return call


VERSIONS = {1: ("teaching, float64", with_fn(teaching.adamw_update_bf16)),
            2: ("words of two, float64", with_fn(pairs.adamw_update_bf16_pairs)),
            3: ("units of 8, float32", with_fn(fast.adamw_update_bf16))}


MAX_ELEMENTS = 200_000_000     # d24 and up: the first 200M parameters (the rate does not depend on n by then;
#                                the whole of d48 with its float64 reference would need ~100 GB)


def cases(cfg, B):
    import cupy as cp
    n = min(cfg.num_parameters(), MAX_ELEMENTS) // 8 * 8
    decay = n // 2

    def make():
        master = harness.rand(n, 0.02, "f32")
        return {"params": harness.to_bf16(master), "master": master, "grads": harness.rand(n, 0.01),
                "m": harness.rand(n, 1e-3, "f32"), "v": cp.abs(harness.rand(n, 1e-5, "f32")) + np.float32(1e-7),
                "scalars": cp.asarray(np.array([3e-4, 0.7, 1 - BETA1 ** 5, 1 - BETA2 ** 5, 5.0])),
                "decay": cp.empty(decay, cp.uint8)}

    def reference(d):
        p, m, v = harness.f64(d["master"]), harness.f64(d["m"]), harness.f64(d["v"])
        teaching.adamw_update_ref(p, harness.f64(d["grads"]), m, v, decay, harness.host(d["scalars"]), BETA1, BETA2, EPS,
                                  WD)
        return {"master": p, "m": m, "v": v, "params": p}
    yield f"update {n / 1e6:.0f}M", make, (), reference, 28 * n, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("adamw", __doc__, VERSIONS, cases, sys.argv[1:]))
