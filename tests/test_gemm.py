"""The product behind every layer: c (+)= alpha * op(a) @ op(b), one or a batch, every transpose.
The tiled teaching kernel in the simulator (and on a GPU); cuBLAS on a GPU, in full fp32 and in TF32."""
import numpy as np
import pytest

from helpers import poisoned, rel_err
from llmz.kernels.gemm import gemm, gemm_ref, gemm_tiled

TRANSPOSES = [(False, False), (True, False), (False, True), (True, True)]


def _operands(rng, Z, M, N, K, trans_a, trans_b):
    lead = (Z,) if Z else ()
    a = rng.normal(size=lead + ((K, M) if trans_a else (M, K)))
    b = rng.normal(size=lead + ((N, K) if trans_b else (K, N)))
    c0 = rng.normal(size=lead + (M, N))
    return a, b, c0


def _check(dev, rng, Z, M, N, K, trans_a, trans_b, accumulate, alpha, fn, tol):
    a, b, c0 = _operands(rng, Z, M, N, K, trans_a, trans_b)
    # overwritten outputs start as NaN (an unwritten element fails); accumulated ones from random values
    c = dev.asarray(c0, np.float32) if accumulate else poisoned(dev, c0.shape)
    fn(dev, c, dev.asarray(a, np.float32), dev.asarray(b, np.float32), trans_a, trans_b, accumulate, alpha)
    ref = c0.copy()
    gemm_ref(ref, a, b, trans_a, trans_b, accumulate, alpha)
    err = rel_err(dev.to_host(c), ref)
    assert err < tol, err
    return err


@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_tiled_batched_matches_reference_with_alpha_and_accumulate(kdev, rng, trans_a, trans_b, accumulate):
    # 3 products of (17 x 19) @ (19 x 5): past a tile edge in every dimension
    # float32 inputs, sums of 19 products in float64: a few ulps
    _check(kdev, rng, 3, 17, 5, 19, trans_a, trans_b, accumulate, 0.37, gemm_tiled, 1e-6)


def test_gemm_dispatches_to_the_tiled_kernel_without_cublas(kdev, rng):
    assert kdev.matmul == "numba"
    _check(kdev, rng, 0, 9, 7, 11, False, True, True, 1.0, gemm, 1e-6)


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
