"""The encoder (token + position embedding), version by version (llm.c's dev/cuda role): forward and backward,
each version checked against the float64 reference on fresh random bf16 inputs and timed at d12..d48, a
table last (dev/harness.py). The backward twice: tokens uniform over the vocabulary (runs of one position,
what `python -m llmz.bench` feeds), and Zipf-distributed like text (a few tokens hold many positions: the
longest run is the kernel's critical path).

    python dev/encoder.py [--model d48] [-b 8] [VERSION ...]

version 1: the teaching kernels (llmz.kernels.encoder): a thread per element; the wte backward a thread per
           channel walking every position
version 2: the wte backward over the positions sorted by token (llmz.fast.encoder's bucket kernel: a block
           per token run, a thread per channel, the run's positions one after another, 2-byte loads)
version 3: llmz.fast.encoder's units kernels (16-byte loads): the forward two units a thread; the wte backward
           a block per (run, 256 channels), the run's positions split over 4 warps, 4 in flight a warp; the
           wpe backward a thread per (t, unit)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from llmz.device import ceil_div
from llmz.fast import encoder as fast
from llmz.fast.encoder import encoder_backward_wte_bucket_kernel, wte_buckets
from llmz.kernels import encoder as teaching
from llmz.kernels.encoder import encoder_backward_ref, encoder_backward_wpe_kernel, encoder_forward_ref


def v2_backward(dev, d):
    B, T, C = d["dout"].shape
    bs = dev.block_size
    dev.launch(encoder_backward_wpe_kernel, ceil_div(T * C, bs), bs, d["dwpe"], d["dout"])
    dev.launch(encoder_backward_wte_bucket_kernel, (B * T, ceil_div(C, bs)), bs, d["dwte"],
               d["dout"].reshape(B * T, C), d["buckets"])


FORWARD = {1: lambda dev, d: teaching.encoder_forward(dev, d["out"], d["inp"], d["wte"], d["wpe"]),
           3: lambda dev, d: fast.encoder_forward(dev, d["out"], d["inp"], d["wte"], d["wpe"])}
BACKWARD = {1: lambda dev, d: teaching.encoder_backward(dev, d["dwte"], d["dwpe"], d["dout"], d["inp"]),
            2: v2_backward,
            3: lambda dev, d: fast.encoder_backward(dev, d["dwte"], d["dwpe"], d["dout"], d["inp"], d["buckets"])}
CASES = {"forward": FORWARD, "backward, uniform tokens": BACKWARD, "backward, Zipf tokens": BACKWARD}
NAMES = {1: "teaching", 2: "token buckets, 2-byte loads", 3: "units"}
VERSIONS = {v: (NAMES[v], lambda dev, d, case, v=v: CASES[case][v](dev, d)) for v in NAMES}


def tokens(B, T, V, zipf: bool) -> np.ndarray:
    rng = np.random.default_rng()
    if zipf:
        return np.minimum(rng.zipf(1.2, (B, T)) - 1, V - 1).astype(np.int32)
    return rng.integers(0, V, (B, T)).astype(np.int32)


def cases(cfg, B):
    import cupy as cp
    T, C, V, Vp = harness.T, cfg.channels, cfg.vocab_size, cfg.padded_vocab_size
    n = B * T * C

    def make(zipf):
        def arrays():
            inp = tokens(B, T, V, zipf)
            return {"inp": cp.asarray(inp), "buckets": cp.asarray(wte_buckets(inp)), "wte": harness.rand((Vp, C)),
                    "wpe": harness.rand((T, C)), "out": cp.zeros((B, T, C), cp.uint16),
                    "dout": harness.rand((B, T, C)), "dwte": harness.rand((Vp, C)), "dwpe": harness.rand((T, C))}
        return arrays

    def forward_ref(d):
        out = np.empty((B, T, C))
        encoder_forward_ref(out, harness.host(d["inp"]), harness.host(harness.f64(d["wte"])),
                            harness.host(harness.f64(d["wpe"])))
        return {"out": cp.asarray(out)}

    def backward_ref(d):
        dwte, dwpe = harness.host(harness.f64(d["dwte"])), harness.host(harness.f64(d["dwpe"]))
        encoder_backward_ref(dwte, dwpe, harness.host(harness.f64(d["dout"])), harness.host(d["inp"]))
        return {"dwte": cp.asarray(dwte), "dwpe": cp.asarray(dwpe)}
    yield ("forward", make(False), ("out",), forward_ref, 4 * n + 2 * T * C, harness.BF16_TOL,
           lambda v: v in FORWARD)
    for zipf in (False, True):
        # dout read once; each position's token row and dwpe read and written (an upper bound for Zipf)
        yield (f"backward, {'Zipf' if zipf else 'uniform'} tokens", make(zipf), (), backward_ref,
               2 * n + 2 * 2 * n + 4 * T * C, harness.BF16_TOL, lambda v: True)


if __name__ == "__main__":
    sys.exit(harness.run("encoder", __doc__, VERSIONS, cases, sys.argv[1:]))
