"""Gradient norm and clipping (llmz/kernels/norm.py; no fast version): the two-pass float64 sum against NumPy,
bit-identical between runs, bf16 gradients summed as their exact float32 values; the clipping factor in both
branches and with clipping off."""
import math

import numpy as np
import pytest

from helpers import poisoned, rand_bf16
from llmz.bf16 import bf16_to_f32
from llmz.kernels.norm import (
    NORM_BLOCKS,
    clip_scale,
    clip_scale_ref,
    global_norm_ref,
    norm_squared,
    norm_squared_ref,
)


def run_norm_squared(kdev, x):
    out = poisoned(kdev, (1,), np.float64)
    scratch = poisoned(kdev, (NORM_BLOCKS,), np.float64)       # slots past the blocks used must not be read
    norm_squared(kdev, out, x, scratch)
    return kdev.to_host(out)[0]


@pytest.mark.parametrize("n", [5, 1000 + 7])                  # under one block; not a multiple of it
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norm_squared_kernel_matches_float64_sum(kdev, rng, n, dtype):
    x = rng.normal(size=n).astype(dtype)
    got = run_norm_squared(kdev, kdev.asarray(x))
    # float64 accumulation of exact float64 squares: only summation-order rounding
    assert abs(got - np.sum(x.astype(np.float64) ** 2)) <= 1e-13 * got


def test_norm_squared_kernel_is_deterministic_over_grid_strides(kdev, rng):
    x = rng.normal(size=2 * 32 * 32 + 7).astype(np.float32)      # in sim: 32 blocks of 32, 2-3 strides each
    a, b = run_norm_squared(kdev, kdev.asarray(x)), run_norm_squared(kdev, kdev.asarray(x))
    assert a.tobytes() == b.tobytes()                              # the same bits, run after run
    assert abs(a - np.sum(x.astype(np.float64) ** 2)) <= 1e-13 * a


def test_norm_squared_accumulate_sums_over_several_arrays(kdev, rng):
    arrays = [rng.normal(size=s).astype(np.float32) for s in (40, 7, 65)]
    expected = global_norm_ref(arrays) ** 2
    out = poisoned(kdev, (1,), np.float64)                      # the first call overwrites, the others add
    ref = np.full(1, np.nan)
    scratch = poisoned(kdev, (NORM_BLOCKS,), np.float64)
    for i, a in enumerate(arrays):
        norm_squared(kdev, out, kdev.asarray(a), scratch, accumulate=i > 0)
        norm_squared_ref(ref, a, None, accumulate=i > 0)
    for got in (kdev.to_host(out)[0], ref[0]):
        assert abs(got - expected) <= 1e-13 * expected


def test_norm_squared_reference_matches_float64_sum(rng):
    x = rng.normal(size=1007).astype(np.float32)
    out = np.full(1, np.nan)
    norm_squared_ref(out, x, None)
    assert abs(out[0] - np.sum(x.astype(np.float64) ** 2)) <= 1e-13 * out[0]


def test_global_norm_ref_is_norm_of_concatenation(rng):
    arrays = [rng.normal(size=s).astype(np.float32) for s in ((3, 4), (7,), (2, 5, 3))]
    whole = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float64)
    assert abs(global_norm_ref(arrays) - math.sqrt(np.sum(whole**2))) <= 1e-14 * global_norm_ref(arrays)


@pytest.mark.parametrize("norm, clip, expected", [
    (5.0, 1.0, 0.2),        # above the threshold: scale down to exactly `clip`
    (0.5, 1.0, 1.0),        # below: leave the gradient alone
    (5.0, 0.0, 1.0),        # clip = 0 means clipping is off
])
def test_clip_scale_writes_only_the_grad_scale(kdev, rng, norm, clip, expected):
    start = rng.random(4) + 0.5                                    # the other scalars: must stay as they are
    norm_sq = np.array([norm * norm])
    ref = start.copy()
    clip_scale_ref(ref, norm_sq, clip)
    scalars = kdev.asarray(start)
    clip_scale(kdev, scalars, kdev.asarray(norm_sq), clip)
    got = kdev.to_host(scalars)
    for s in (ref, got):
        assert s[1] == pytest.approx(expected, rel=1e-15)
        assert np.array_equal(np.delete(s, 1), np.delete(start, 1))
    assert got[1] == ref[1]


@pytest.mark.gpu
def test_norm_squared_matches_float64_reference_at_gpt2_size(kdev, rng):
    n = 124_475_904
    x = rng.normal(size=n).astype(np.float32)
    dx = kdev.asarray(x)
    a, b = run_norm_squared(kdev, dx), run_norm_squared(kdev, dx)
    ref = np.full(1, np.nan)
    norm_squared_ref(ref, x, None)
    err = abs(a - ref[0]) / ref[0]
    print(f"norm_squared n={n}: rel err {err:.2e}")
    assert err < 1e-12 and a.tobytes() == b.tobytes()


def test_norm_squared_of_bf16_gradients_equals_the_float32_sum_bit_for_bit(kdev, rng):
    x = rand_bf16(rng, 300)
    scratch = kdev.asarray(np.zeros(NORM_BLOCKS))
    out, out32 = kdev.asarray(np.full(1, np.nan)), kdev.asarray(np.full(1, np.nan))
    norm_squared(kdev, out, kdev.asarray(x), scratch)
    norm_squared(kdev, out32, kdev.asarray(bf16_to_f32(x)), scratch)
    # exact float32 values summed in float64 in the same order: the same bits
    np.testing.assert_array_equal(kdev.to_host(out), kdev.to_host(out32))
    ref = np.full(1, np.nan)
    norm_squared_ref(ref, x, None)
    # float64 sums of 300 terms of size ~1, another order
    np.testing.assert_allclose(kdev.to_host(out), ref, rtol=1e-13)
    assert ref[0] == pytest.approx(float(np.sum(bf16_to_f32(x).astype(np.float64) ** 2)), rel=1e-13)


@pytest.mark.gpu
def test_norm_of_bf16_gradients_equals_the_float32_norm_at_gpt2_size(kdev, rng):
    n = 124_475_904                                      # GPT-2 124M's parameter count
    x = rand_bf16(rng, n, 1e-3)
    scratch = kdev.asarray(np.zeros(NORM_BLOCKS))
    out, out32 = kdev.asarray(np.full(1, np.nan)), kdev.asarray(np.full(1, np.nan))
    norm_squared(kdev, out, kdev.asarray(x), scratch)
    norm_squared(kdev, out32, kdev.asarray(bf16_to_f32(x)), scratch)
    got, want = kdev.to_host(out)[0], kdev.to_host(out32)[0]
    print(f"norm^2 of 124M bf16 values: {got!r}, float32 kernel {want!r}, relative difference "
          f"{abs(got - want) / want:.3e} (bound 0: the same float64 sum of the same exact values)")
    assert got == want
