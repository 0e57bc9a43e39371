"""The linear layer's products with their neighbours, version by version: today's kernels, the unit
candidates around cuBLAS, and the neighbours fused into cuBLASLt's epilogues (llm.c's matmul_cublaslt), each
checked against the float64 reference on fresh random bf16 inputs and timed at the MLP's and the qkv's shapes
of d12..d48, a table last (dev/harness.py): the choice between our ctypes binding of cuBLASLt (dev/cublaslt.py)
and NVIDIA's maintained binding, nvmath-python.

    python dev/matmul.py [--model d48] [-b 8] [VERSION ...]

cases (N = B*T rows):
  bias             fc's forward: out (N,4C) = inp (N,C) @ W.T + b
  bias + gelu      fc's forward and the GELU: fch = inp @ W.T + b (kept for backward), fch_gelu = gelu(fch)
  dgelu            fcproj's backward into the GELU's input: dfch = (dout (N,C) @ Wp (C,4C)) * gelu'(fch)
  dW + bias grad   qkv's weight gradient and bias gradient: dW (3C,C) += dout (N,3C).T @ inp, dbias = sum of
                   dout's rows (from zero: cuBLASLt's gradient epilogues overwrite)
version 1: fast set (llmz.fast.matmul): bias fill, cuBLAS, the GELU / column-sum kernels (d48 fills 6.6 ms)
version 2: v1 with the unit candidates (fill on 16-byte stores, gelu and column_sum v3); not yet run on a GPU
version 3: cuBLASLt epilogues through our ctypes binding (dev/cublaslt.py); not yet run on a GPU
version 4: the same epilogues through nvmath-python; predicts v3's times within noise; not yet run on a GPU
(v4's result is a new tensor: its copy into the checked array is not timed.)
Bytes: the product's operands and results once each (the rate column is not the point here: compare us).
"""
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import harness
from dev.column_sum import column_sum_units
from dev.cublaslt import matmul_lt
from dev.gelu import gelu_backward_units, gelu_forward_units
from dev.vectors import UNIT, load8, store8, units_fit
from llmz.fast import gelu as fast_gelu
from llmz.fast import matmul as fast_matmul
from llmz.fast.column_sum import column_sum
from llmz.fast.gemm import gemm
from llmz.fast.matmul import FILL_ROWS
from llmz.kernels.gelu import gelu_backward_ref, gelu_forward_ref
from llmz.kernels.grid import ceil_div


# ---- version 2's bias fill: 16-byte stores -----------------------------------------------------------------
@cuda.jit
def matmul_bias_fill_units_kernel(out, bias, OC):
    """out (N*OC,) flat = bias (OC,) in every row, OC % 8 == 0. Grid (ceil(N/FILL_ROWS), ceil(OC/8/blockDim)):
    thread (r, u) writes unit u (columns 8u..8u+7) of rows r, r+S, ... (S = gridDim.x). Overwrites out: the
    teaching kernel's bits."""
    u = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if u >= OC // UNIT:
        return
    b0, b1, b2, b3, b4, b5, b6, b7 = load8(bias, UNIT * u)
    for r in range(cuda.blockIdx.x, out.shape[0] // OC, cuda.gridDim.x):
        store8(out, r * OC + UNIT * u, b0, b1, b2, b3, b4, b5, b6, b7)


def matmul_forward_units(dev, out, inp, weight, bias) -> None:
    """llmz.fast.matmul.matmul_forward's call with the bias filled on units (llmz.fast's fill where they do not
    fit): out = bias in every row, then out += inp @ weight.T."""
    OC = weight.shape[0]
    out2 = out.reshape(-1, OC)
    if bias is None or OC % UNIT or out2.dtype != bias.dtype or not units_fit(out2, bias):
        return fast_matmul.matmul_forward(dev, out, inp, weight, bias)
    # a block per FILL_ROWS rows and up to dev.block_size units: no idle threads at OC = 768 (96 units)
    threads = min(dev.block_size, ceil_div(OC // UNIT, 32) * 32)
    dev.launch(matmul_bias_fill_units_kernel, (ceil_div(out2.shape[0], FILL_ROWS), ceil_div(OC // UNIT, threads)),
               threads, out2.reshape(-1), bias, OC)
    gemm(dev, out2, inp.reshape(-1, inp.shape[-1]), weight, False, True, True)


# ---- versions 1 and 2: the layers' kernels around cuBLAS ---------------------------------------------------
def around_cublas(forward, gelu_forward, gelu_backward, bias_grad):
    """A version made of layer functions around llmz.fast.gemm's cuBLAS products."""
    def call(dev, d, case):
        if case == "bias":
            forward(dev, d["out"], d["inp"], d["w"], d["b"])
        elif case == "bias + gelu":
            forward(dev, d["fch"], d["inp"], d["w"], d["b"])
            gelu_forward(dev, d["out"], d["fch"])
        elif case == "dgelu":
            tmp = dev.scratch("dev_dgelu", d["out"].shape, np.uint16)
            gemm(dev, tmp, d["dout"], d["wp"], False, False, False)
            gelu_backward(dev, d["out"], d["fch"], tmp, accumulate=False)
        else:
            gemm(dev, d["dw"], d["dout3"], d["inp"], True, False, True)
            bias_grad(dev, d["dbias"], d["dout3"])
    return call


# ---- version 3: our cuBLASLt binding ----------------------------------------------------------------------
def lt(dev, d, case):
    if case == "bias":
        matmul_lt(dev, d["out"], d["inp"], d["w"], False, True, False, "bias", bias=d["b"])
    elif case == "bias + gelu":
        matmul_lt(dev, d["out"], d["inp"], d["w"], False, True, False, "gelu_aux_bias", bias=d["b"], aux=d["fch"])
    elif case == "dgelu":
        matmul_lt(dev, d["out"], d["dout"], d["wp"], False, False, False, "dgelu", aux=d["fch"])
    else:
        matmul_lt(dev, d["dw"], d["dout3"], d["inp"], True, False, True, "bgradb", bias=d["dbias"])


# ---- version 4: nvmath-python ---------------------------------------------------------------------------
PLANS: dict = {}


def bf16(a):
    """A CuPy uint16 (bf16 bits) array as a torch bfloat16 tensor over the same memory."""
    import torch
    return torch.from_dlpack(a).view(torch.bfloat16)


def nvmath(dev, d, case):
    """nvmath works column-major in cuBLASLt's terms on its operands' layouts: each product is written as its
    transpose (result (cols, rows) = the row-major array read as a transposed view), so that its bias is one
    per row of the result, as nvmath's BIAS epilog broadcasts it."""
    import torch
    from nvmath.linalg.advanced import Matmul, MatmulEpilog
    # the operands are torch tensors, so the stream must be torch's too (nvmath refuses a CuPy stream with them:
    # "The stream object must belong to the same package as the tensor network operands"): our compute stream
    # wrapped as a torch ExternalStream, so the products queue in order with the rest
    stream = torch.cuda.ExternalStream(dev.compute_stream.cupy.ptr)
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
    with torch.cuda.stream(stream):                 # the copies into the checked arrays, on the same stream
        if case == "dW + bias grad":
            bf16(d["dw"]).copy_(bf16(d["dw"]) + out.T)
            bf16(d["dbias"]).copy_(aux["bgradb"].reshape(-1))
        else:
            bf16(d["out"]).copy_(out.T)
            if "gelu_aux" in aux:
                bf16(d["fch"]).copy_(aux["gelu_aux"].T)
    return lambda: plan.execute(stream=stream)


VERSIONS = {1: ("fill, kernels + cuBLAS (fast set)",
                around_cublas(fast_matmul.matmul_forward, fast_gelu.gelu_forward, fast_gelu.gelu_backward, column_sum)),
            2: ("units fill, kernels + cuBLAS (candidate)",
                around_cublas(matmul_forward_units, gelu_forward_units, gelu_backward_units, column_sum_units)),
            3: ("cuBLASLt, our ctypes (candidate)", lt),
            4: ("cuBLASLt, nvmath-python (candidate)", nvmath)}


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
