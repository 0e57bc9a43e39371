"""The linear layer's products with their neighbours fused into cuBLASLt's epilogues (llm.c's
matmul_cublaslt), version by version, each checked against the float64 reference on fresh random bf16 inputs
and timed at the MLP's and the qkv's shapes of d12..d48, a table last (dev/harness.py): the choice between
our ctypes binding of cuBLASLt (llmz.fast.cublaslt) and NVIDIA's maintained binding, nvmath-python.

    python dev/matmul.py [--model d48] [-b 8] [VERSION ...]

cases (N = B*T rows):
  bias             fc's forward: out (N,4C) = inp (N,C) @ W.T + b
  bias + gelu      fc's forward and the GELU: fch = inp @ W.T + b (kept for backward), fch_gelu = gelu(fch)
  dgelu            fcproj's backward into the GELU's input: dfch = (dout (N,C) @ Wp (C,4C)) * gelu'(fch)
  dW + bias grad   qkv's weight gradient and bias gradient: dW (3C,C) += dout (N,3C).T @ inp, dbias = sum of
                   dout's rows (from zero: cuBLASLt's gradient epilogues overwrite)
version 1: what llmz.fast runs today: the bias fill kernel then cuBLAS accumulating onto it; the product then
           llmz.fast.gelu's kernels; the product then llmz.fast.column_sum
version 2: llmz.fast.cublaslt.matmul_lt: cuBLASLt through our ctypes handle, the epilogue in the product
version 3: nvmath-python's Matmul (planned once, executed per call; torch bf16 tensors over the same memory),
           the same epilogues (its result is a new tensor: the copy into the checked array is not timed)
Bytes: the product's operands and results once each (the rate column is not the point here: compare us).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from llmz.fast import gelu as fast_gelu
from llmz.fast import matmul as fast_matmul
from llmz.fast.column_sum import column_sum
from llmz.fast.cublaslt import matmul_lt
from llmz.fast.gemm import gemm
from llmz.kernels.gelu import gelu_backward_ref, gelu_forward_ref


# ---- version 1: today's kernels -------------------------------------------------------------------------
def v1(dev, d, case):
    if case == "bias":
        fast_matmul.matmul_forward(dev, d["out"], d["inp"], d["w"], d["b"])
    elif case == "bias + gelu":
        fast_matmul.matmul_forward(dev, d["fch"], d["inp"], d["w"], d["b"])
        fast_gelu.gelu_forward(dev, d["out"], d["fch"])
    elif case == "dgelu":
        tmp = dev.scratch("dev_dgelu", d["out"].shape, np.uint16)
        gemm(dev, tmp, d["dout"], d["wp"], False, False, False)
        fast_gelu.gelu_backward(dev, d["out"], d["fch"], tmp, accumulate=False)
    else:
        gemm(dev, d["dw"], d["dout3"], d["inp"], True, False, True)
        column_sum(dev, d["dbias"], d["dout3"])


# ---- version 2: our cuBLASLt binding ----------------------------------------------------------------------
def v2(dev, d, case):
    if case == "bias":
        matmul_lt(dev, d["out"], d["inp"], d["w"], False, True, False, "bias", bias=d["b"])
    elif case == "bias + gelu":
        matmul_lt(dev, d["out"], d["inp"], d["w"], False, True, False, "gelu_aux_bias", bias=d["b"], aux=d["fch"])
    elif case == "dgelu":
        matmul_lt(dev, d["out"], d["dout"], d["wp"], False, False, False, "dgelu", aux=d["fch"])
    else:
        matmul_lt(dev, d["dw"], d["dout3"], d["inp"], True, False, True, "bgradb", bias=d["dbias"])


# ---- version 3: nvmath-python ---------------------------------------------------------------------------
PLANS: dict = {}


def bf16(a):
    """A CuPy uint16 (bf16 bits) array as a torch bfloat16 tensor over the same memory."""
    import torch
    return torch.from_dlpack(a).view(torch.bfloat16)


def v3(dev, d, case):
    """nvmath works column-major in cuBLASLt's terms on its operands' layouts: each product is written as its
    transpose (result (cols, rows) = the row-major array read as a transposed view), so that its bias is one
    per row of the result, as nvmath's BIAS epilog broadcasts it."""
    from nvmath.linalg.advanced import Matmul, MatmulEpilog
    stream = dev.compute_stream.cupy
    key = (case, d["inp"].shape, d["w"].shape)
    plan = PLANS.get(key)
    if plan is None:
        if case == "bias":
            mm = Matmul(bf16(d["w"]), bf16(d["inp"]).T, stream=stream)
            mm.plan(epilog=MatmulEpilog.BIAS, epilog_inputs={"bias": bf16(d["b"])}, stream=stream)
        elif case == "bias + gelu":
            mm = Matmul(bf16(d["w"]), bf16(d["inp"]).T, stream=stream)
            mm.plan(epilog=MatmulEpilog.GELU_AUX_BIAS, epilog_inputs={"bias": bf16(d["b"])}, stream=stream)
        elif case == "dgelu":
            mm = Matmul(bf16(d["wp"]).T, bf16(d["dout"]).T, stream=stream)
            mm.plan(epilog=MatmulEpilog.DGELU, epilog_inputs={"gelu_aux": bf16(d["fch"]).T}, stream=stream)
        else:
            mm = Matmul(bf16(d["inp"]).T, bf16(d["dout3"]), stream=stream)
            mm.plan(epilog=MatmulEpilog.BGRADB, stream=stream)
        plan = PLANS[key] = mm
    result = plan.execute(stream=stream)
    out, aux = result if isinstance(result, tuple) else (result, {})
    if case == "dW + bias grad":
        bf16(d["dw"]).copy_(bf16(d["dw"]) + out.T)
        bf16(d["dbias"]).copy_(aux["bgradb"].reshape(-1))
    else:
        bf16(d["out"]).copy_(out.T)
        if "gelu_aux" in aux:
            bf16(d["fch"]).copy_(aux["gelu_aux"].T)
    return lambda: plan.execute(stream=stream)


VERSIONS = {1: ("fill/kernel + cuBLAS", v1), 2: ("cuBLASLt, our ctypes", v2), 3: ("cuBLASLt, nvmath-python", v3)}


def cases(cfg, B):
    import cupy as cp
    N, C = B * harness.T, cfg.channels

    def make():
        return {"inp": harness.rand((N, C)), "w": harness.rand((4 * C, C), 0.02), "b": harness.rand(4 * C, 0.1),
                "wp": harness.rand((C, 4 * C), 0.02), "dout": harness.rand((N, C)), "fch": harness.rand((N, 4 * C)),
                "out": cp.zeros((N, 4 * C), cp.uint16), "dout3": harness.rand((N, 3 * C)),
                "dw": cp.zeros((3 * C, C), cp.uint16), "dbias": cp.zeros(3 * C, cp.uint16)}

    def ref(case):
        def reference(d):
            f = {k: harness.f64(v) for k, v in d.items()}
            if case == "dW + bias grad":
                return {"dw": f["dout3"].T @ f["inp"], "dbias": f["dout3"].sum(axis=0)}
            if case == "dgelu":
                g = cp.empty((N, 4 * C))
                gelu_backward_ref(g, f["fch"], f["dout"] @ f["wp"], accumulate=False)
                return {"out": g}
            pre = f["inp"] @ f["w"].T + f["b"]
            if case == "bias":
                return {"out": pre}
            out = cp.empty_like(pre)
            gelu_forward_ref(out, pre)
            return {"out": out, "fch": pre}
        return reference
    sizes = {"bias": 2 * N * C + 8 * C * C + 8 * N * C, "bias + gelu": 2 * N * C + 8 * C * C + 16 * N * C,
             "dgelu": 2 * N * C + 8 * C * C + 16 * N * C, "dW + bias grad": 6 * N * C + 2 * N * C + 12 * C * C}
    outputs = {"bias": ("out",), "bias + gelu": ("out", "fch"), "dgelu": ("out",), "dW + bias grad": ()}
    for case, nbytes in sizes.items():
        yield case, make, outputs[case], ref(case), nbytes, harness.BF16_TOL, lambda v: True


if __name__ == "__main__":
    sys.exit(harness.run("matmul", __doc__, VERSIONS, cases, sys.argv[1:]))
