"""The fused classifier (softmax + cross-entropy: the losses and dlogits written over the logits), version by
version (llm.c's dev/cuda role), and the losses alone (the forward), each version checked against the float64
reference on fresh random bf16 logits and timed at (B*T, Vp = 50304), a table last (dev/harness.py). Bytes:
the logits read once and written once (fused), read once (losses): what a kernel must move.

    python dev/classifier.py [--model d48] [-b 8] [VERSION ...]

version 1: the teaching kernels (llmz.kernels.classifier): the forward (three reads of the row, a probs
           buffer) then the backward
version 2: one block a row, max and sum in one read, the dlogits in a second read (mostly from L2), words of
           two (llmz.fast.classifier's classifier_fused_pairs_kernel: the float32 path)
version 3: llmz.fast.classifier's units kernel (bf16): the row in registers (a block of 1024 threads, 7 units
           of 8 a thread at Vp = 50304), one read and one write
The rows of every model size are alike (Vp is the vocabulary's): the sizes differ only in B*T.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from llmz.fast import classifier as fast
from llmz.fast.classifier import (
    classifier_fused_pairs_kernel,
    classifier_loss_pairs_kernel,
    row_block,
)
from llmz.fast.device_helpers import pair_view
from llmz.kernels import classifier as teaching

DLOSS = 1.0 / 8192


def pairs(dev, d, fused: bool):
    x = d["logits"]
    if fused:
        dev.launch(classifier_fused_pairs_kernel, x.shape[0], row_block(dev) // 2, d["losses"], pair_view(x),
                   d["targets"], DLOSS, d["V"].size)
    else:
        dev.launch(classifier_loss_pairs_kernel, x.shape[0], row_block(dev) // 2, d["losses"], pair_view(x),
                   d["targets"], d["V"].size)


CASES = {
    "fused": {1: lambda dev, d: teaching.classifier_fused(dev, d["losses"], d["logits"], d["targets"], DLOSS,
                                                          d["V"].size),
              2: lambda dev, d: pairs(dev, d, True),
              3: lambda dev, d: fast.classifier_fused(dev, d["losses"], d["logits"], d["targets"], DLOSS,
                                                      d["V"].size)},
    "losses": {1: lambda dev, d: teaching.classifier_loss(dev, d["losses"], d["logits"], d["targets"], d["V"].size),
               2: lambda dev, d: pairs(dev, d, False),
               3: lambda dev, d: fast.classifier_loss(dev, d["losses"], d["logits"], d["targets"], d["V"].size)},
}
NAMES = {1: "teaching", 2: "two reads, words of two", 3: "units, row in registers"}
VERSIONS = {v: (NAMES[v], lambda dev, d, case, v=v: CASES[case][v](dev, d)) for v in NAMES}


def cases(cfg, B):
    import cupy as cp
    N, V, Vp = B * harness.T, cfg.vocab_size, cfg.padded_vocab_size

    def make():
        return {"logits": harness.rand((N, Vp), 3.0), "losses": cp.zeros(N, cp.float32),
                "targets": cp.random.randint(0, V, N).astype(cp.int32), "V": cp.empty(V, cp.uint8)}

    def reference(fused):
        def ref(d):
            x = harness.f64(d["logits"])[:, :V]
            m = x.max(axis=1)
            e = cp.exp(x - m[:, None])
            s = e.sum(axis=1)
            rows = cp.arange(N)
            t = d["targets"].astype(cp.int64)
            want = {"losses": cp.log(s) - (x[rows, t] - m)}
            if fused:
                dl = cp.zeros((N, Vp))
                dl[:, :V] = e / s[:, None]
                dl[rows, t] -= 1.0
                want["logits"] = dl * DLOSS
            return want
        return ref
    row = N * Vp * 2
    yield "fused", make, ("losses",), reference(True), 2 * row + 8 * N, harness.BF16_TOL, lambda v: True
    yield "losses", make, ("losses",), reference(False), row + 8 * N, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("classifier", __doc__, VERSIONS, cases, sys.argv[1:]))
