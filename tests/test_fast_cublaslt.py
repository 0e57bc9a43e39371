"""cuBLASLt through our ctypes handle (llmz/fast/cublaslt.py): each epilogue against the float64 reference on
random bf16 inputs (a GPU only: cuBLASLt needs one). bf16 products accumulate in float32 and round once:
1e-2 relative (normwise) is a few bf16 roundings."""
import numpy as np
import pytest

from helpers import rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.gelu import gelu_backward_ref, gelu_forward_ref

pytestmark = pytest.mark.gpu
N, C, OC = 512, 256, 384                 # rows, inputs, outputs (each a multiple of 8, as the epilogues need)


@pytest.fixture(scope="module")
def bdev():
    from llmz.device import Device
    return Device("gpu", np.uint16, kernel_set="fast")


def b16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.normal(size=shape) * scale).astype(np.float32))


def f64(bits):
    return bf16_to_f32(np.asarray(bits)).astype(np.float64)


def test_cublaslt_bias_and_gelu_aux_bias_match_float64(bdev, rng):
    from llmz.fast.cublaslt import matmul_lt
    inp, w, b = b16(rng, (N, C)), b16(rng, (OC, C), 0.1), b16(rng, OC)
    pre = f64(inp) @ f64(w).T + f64(b)
    out = bdev.zeros((N, OC), np.uint16)
    matmul_lt(bdev, out, bdev.asarray(inp), bdev.asarray(w), False, True, False, "bias", bias=bdev.asarray(b))
    assert rel_err(f64(bdev.to_host(out)), pre) < 1e-2
    aux, act = bdev.zeros((N, OC), np.uint16), bdev.zeros((N, OC), np.uint16)
    matmul_lt(bdev, act, bdev.asarray(inp), bdev.asarray(w), False, True, False, "gelu_aux_bias",
              bias=bdev.asarray(b), aux=aux)
    g = np.empty_like(pre)
    gelu_forward_ref(g, pre)
    assert rel_err(f64(bdev.to_host(aux)), pre) < 1e-2
    assert rel_err(f64(bdev.to_host(act)), g) < 1e-2


def test_cublaslt_dgelu_and_bgrad_epilogues_match_float64(bdev, rng):
    from llmz.fast.cublaslt import matmul_lt
    dout, wp, pre = b16(rng, (N, C)), b16(rng, (C, OC), 0.1), b16(rng, (N, OC))
    want = np.empty((N, OC))
    gelu_backward_ref(want, f64(pre), f64(dout) @ f64(wp), accumulate=False)
    for epilogue in ("dgelu", "dgelu_bgrad"):
        d, db = bdev.zeros((N, OC), np.uint16), bdev.zeros(OC, np.uint16)
        matmul_lt(bdev, d, bdev.asarray(dout), bdev.asarray(wp), False, False, False, epilogue, aux=bdev.asarray(pre),
                  bias=db if epilogue == "dgelu_bgrad" else None)
        assert rel_err(f64(bdev.to_host(d)), want) < 1e-2, epilogue
        if epilogue == "dgelu_bgrad":
            assert rel_err(f64(bdev.to_host(db)), f64(bdev.to_host(d)).sum(axis=0)) < 1e-2
    # the weight gradient with the bias gradient: dW (+)= dout.T @ inp, dbias = column sums of dout
    g3, inp = b16(rng, (N, OC)), b16(rng, (N, C))
    dw0 = b16(rng, (OC, C))
    dw, dbias = bdev.asarray(dw0), bdev.zeros(OC, np.uint16)
    matmul_lt(bdev, dw, bdev.asarray(g3), bdev.asarray(inp), True, False, True, "bgradb", bias=dbias)
    assert rel_err(f64(bdev.to_host(dw)), f64(dw0) + f64(g3).T @ f64(inp)) < 1e-2
    assert rel_err(f64(bdev.to_host(dbias)), f64(g3).sum(axis=0)) < 1e-2
