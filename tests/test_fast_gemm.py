"""cuBLAS through llmz/fast/gemm.py against the NumPy reference: one product and a batch, every transpose,
full fp32 (to the tiled teaching kernel's accuracy), TF32 and bf16 (a GPU only)."""
import numpy as np
import pytest
from test_gemm import TRANSPOSES, _check, _operands

from helpers import rel_err
from llmz.fast.gemm import gemm
from llmz.kernels.gemm import gemm_ref


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
@pytest.mark.parametrize("Z", [0, 4])
def test_gemm_cublas_matches_reference_in_fp32_and_tf32(fdev, fdev_exact, rng, trans_a, trans_b, Z):
    # shapes of GPT-2's products, not multiples of anything: M=300, N=129, K=770
    for accumulate, alpha in ((False, 1.0), (True, 0.125)):
        exact = _check(fdev_exact, rng, Z, 300, 129, 770, trans_a, trans_b, accumulate, alpha, gemm, 1e-6)
        # TF32 rounds each input to a 10-bit mantissa: ~2^-11 relative per product, averaging over K terms
        tf32 = _check(fdev, rng, Z, 300, 129, 770, trans_a, trans_b, accumulate, alpha, gemm, 2e-3)
        print(f"cuBLAS gemm Z={Z} trans {trans_a},{trans_b} accumulate={accumulate}: relative error fp32 "
              f"{exact:.1e}, TF32 {tf32:.1e}")


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
def test_gemm_cublas_bf16_matches_reference_to_bf16_rounding(fdev, rng, trans_a, trans_b):
    from llmz.bf16 import bf16_to_f32, f32_to_bf16
    M, N, K = 300, 129, 770
    a, b, c0 = _operands(rng, 4, M, N, K, trans_a, trans_b)
    # the reference multiplies the bf16-rounded inputs exactly (float64), adds the bf16-rounded c, and rounds
    a16, b16, c16 = (f32_to_bf16(x.astype(np.float32)) for x in (a, b, c0))
    ref = bf16_to_f32(c16).astype(np.float64)
    gemm_ref(ref, bf16_to_f32(a16).astype(np.float64), bf16_to_f32(b16).astype(np.float64), trans_a, trans_b,
             True, 0.5)
    c = fdev.asarray(c16)
    gemm(fdev, c, fdev.asarray(a16), fdev.asarray(b16), trans_a, trans_b, True, 0.5)
    err = rel_err(bf16_to_f32(fdev.to_host(c)), ref)
    print(f"cuBLAS bf16 gemm trans {trans_a},{trans_b}: relative error {err:.1e}")
    # fp32 accumulation, one bf16 rounding of c: 2^-9 relative per element at most
    assert err < 2.0**-8
