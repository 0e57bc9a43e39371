"""The product behind every layer, c (+)= alpha * op(a) @ op(b), one or a batch, every transpose: the tiled
teaching kernel (llmz/kernels/gemm.py) against NumPy, in float32 and on bf16 storage. cuBLAS (llmz/fast/gemm.py):
tests/test_fast_gemm.py."""
import numpy as np
import pytest

from helpers import NAN_BF16, assert_rounded_float32, assert_within_one_step, poisoned, rand_bf16, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
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


def test_gemm_layer_is_the_tiled_kernel(kdev, rng):
    assert kdev.matmul == "numba"
    _check(kdev, rng, 0, 9, 7, 11, False, True, True, 1.0, gemm, 1e-6)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_tiled_kernel_matches_numpy_for_every_transpose(kdev, rng, trans_a, trans_b):
    M, N, K = 17, 5, 19                       # each one past a tile edge (17 rows: two row tiles)
    a = rng.normal(size=(K, M) if trans_a else (M, K))
    b = rng.normal(size=(N, K) if trans_b else (K, N))
    c = poisoned(kdev, (M, N))
    gemm_tiled(kdev, c, kdev.asarray(a, np.float32), kdev.asarray(b, np.float32), trans_a, trans_b, False)
    ref = (a.T if trans_a else a) @ (b.T if trans_b else b)
    # float32 inputs, sums of 19 products: a few ulps
    assert rel_err(kdev.to_host(c), ref) < 1e-6


# ---- bf16 storage ----------------------------------------------------------------------------------
@pytest.mark.parametrize("trans_a,trans_b,accumulate", [(False, False, False), (True, False, True),
                                                        (False, True, True), (True, True, False)])
def test_gemm_tiled_kernel_on_bf16_is_the_float32_kernel_rounded(kdev, rng, trans_a, trans_b, accumulate):
    M, N, K = 17, 5, 19                                  # past the tile edges
    a = rand_bf16(rng, (K, M) if trans_a else (M, K))
    b = rand_bf16(rng, (N, K) if trans_b else (K, N))
    c0 = rand_bf16(rng, (M, N)) if accumulate else np.full((M, N), NAN_BF16, np.uint16)
    c, c32 = kdev.asarray(c0), kdev.asarray(bf16_to_f32(c0))
    gemm_tiled(kdev, c, kdev.asarray(a), kdev.asarray(b), trans_a, trans_b, accumulate, alpha=0.5)
    gemm_tiled(kdev, c32, kdev.asarray(bf16_to_f32(a)), kdev.asarray(bf16_to_f32(b)), trans_a, trans_b,
               accumulate, alpha=0.5)
    got = kdev.to_host(c)
    assert not np.any(np.isnan(bf16_to_f32(got)))
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(c32)))
    # the reference's bf16 path: the same products, summed in another order (float32 in NumPy): one step
    ref = c0.copy()
    gemm_ref(ref, a, b, trans_a, trans_b, accumulate, alpha=0.5)
    assert_within_one_step(got, ref, atol=1e-5)


def test_gemm_tiled_kernel_mixes_bf16_and_float32_operands(kdev, rng):
    M, N, K = 17, 5, 19
    a, b = rand_bf16(rng, (M, K)), rng.normal(size=(K, N)).astype(np.float32)
    c = kdev.asarray(np.full((M, N), np.nan, np.float32))
    c32 = kdev.asarray(np.full((M, N), np.nan, np.float32))
    gemm_tiled(kdev, c, kdev.asarray(a), kdev.asarray(b), False, False, False)
    gemm_tiled(kdev, c32, kdev.asarray(bf16_to_f32(a)), kdev.asarray(b), False, False, False)
    # a bf16 tile is staged as float32, exactly: the float32 result itself
    np.testing.assert_array_equal(kdev.to_host(c), kdev.to_host(c32))


@pytest.mark.gpu
def test_tiled_gemm_bf16_kernel_matches_float32_kernel_at_gpt2_size(kdev, rng):
    M, K, GC = 4 * 1024, 768, 768                                  # the attention projection: (4096, 768) @ (768, 768).T
    a, b, c0 = rand_bf16(rng, (M, K)), rand_bf16(rng, (GC, K)), rand_bf16(rng, (M, GC))
    c, c32 = kdev.asarray(c0), kdev.asarray(bf16_to_f32(c0))
    gemm_tiled(kdev, c, kdev.asarray(a), kdev.asarray(b), False, True, True)
    gemm_tiled(kdev, c32, kdev.asarray(bf16_to_f32(a)), kdev.asarray(bf16_to_f32(b)), False, True, True)
    got, want = kdev.to_host(c), kdev.to_host(c32)
    assert_rounded_float32("gemm tiled", got, want)


