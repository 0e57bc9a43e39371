"""GELU (llmz/kernels/gelu.py, the teaching kernels): the kernels against the NumPy reference, the reference
against finite differences, bf16 storage (the float32 kernel's results, rounded). The fast kernels:
tests/test_fast_gelu.py."""
import numpy as np
import pytest

from helpers import (
    NAN_BF16,
    assert_rounded_float32,
    assert_within_one_step,
    finite_diff,
    poisoned,
    poisoned_bf16,
    rand_bf16,
    rel_err,
)
from llmz import kernels
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.gelu import gelu_backward, gelu_backward_ref, gelu_forward, gelu_forward_ref

SHAPE = (3, 5, 7)                   # 105 elements: not a multiple of the simulator's 32-thread block


def test_gelu_forward_kernel_matches_reference(kdev, rng):
    x = rng.normal(size=(3, 5, 7)).astype(np.float32) * 3       # 105 elements: not a multiple of the block
    out = poisoned(kdev, x.shape)
    gelu_forward(kdev, out, kdev.asarray(x))
    ref = np.empty_like(x, dtype=np.float64)
    gelu_forward_ref(ref, x.astype(np.float64))
    # float32 tanh and cubes: a few ulps per element
    assert rel_err(kdev.to_host(out), ref) < 1e-6


def test_gelu_backward_kernel_matches_reference_and_accumulates(kdev, rng):
    x = rng.normal(size=(105,)) * 3
    dout = rng.normal(size=x.shape)
    start = rng.normal(size=x.shape)                             # backward accumulates: start non-zero
    dinp = kdev.asarray(start, np.float32)
    gelu_backward(kdev, dinp, kdev.asarray(x, np.float32), kdev.asarray(dout, np.float32))
    ref = start.copy()
    gelu_backward_ref(ref, x, dout)
    assert rel_err(kdev.to_host(dinp), ref) < 1e-6


# one thread per element: in the simulator (32-thread blocks) 5 is less than one block, 300 ten blocks with a
# ragged tail, 33 one element past a full block
@pytest.mark.parametrize("n", [5, 300, 33])
def test_gelu_kernels_write_every_element_when_n_is_off_the_block_grid(kdev, rng, n):
    x = rng.normal(size=n) * 3
    out = poisoned(kdev, n)
    gelu_forward(kdev, out, kdev.asarray(x, np.float32))
    ref = np.empty(n)
    gelu_forward_ref(ref, x.astype(np.float32).astype(np.float64))
    # float32 tanh and cubes: a few ulps per element (a NaN left by a missed element fails)
    assert rel_err(kdev.to_host(out), ref) < 1e-6
    dout, start = rng.normal(size=n), rng.normal(size=n)
    dinp = kdev.asarray(start, np.float32)                        # accumulates: starts random
    gelu_backward(kdev, dinp, kdev.asarray(x, np.float32), kdev.asarray(dout, np.float32))
    want = start.astype(np.float32).astype(np.float64)
    gelu_backward_ref(want, x.astype(np.float32).astype(np.float64), dout.astype(np.float32).astype(np.float64))
    # a missed element keeps its start value: far off
    assert rel_err(kdev.to_host(dinp), want) < 1e-6


def test_gelu_reference_backward_matches_finite_differences(rng):
    x = rng.normal(size=(4, 6)) * 2
    dout = rng.normal(size=x.shape)

    def f(x):
        out = np.empty_like(x)
        gelu_forward_ref(out, x)
        return out
    dinp = np.zeros_like(x)
    gelu_backward_ref(dinp, x, dout)
    idx, g = finite_diff(f, x, dout)
    assert rel_err(dinp.reshape(-1)[idx], g) < 1e-6


def test_gelu_reference_on_bf16_storage_rounds_the_float32_reference(rng):
    # uint16 arrays hold bf16 bits: the reference computes in float32 and rounds its outputs to nearest
    x, dout, start = (f32_to_bf16(rng.normal(size=(4, 25)) * 2) for _ in range(3))
    x0, dout0 = x.copy(), dout.copy()
    out = np.full(x.shape, 0x7FC0, np.uint16)
    gelu_forward_ref(out, x)
    want = np.empty(x.shape, np.float32)
    gelu_forward_ref(want, bf16_to_f32(x))
    np.testing.assert_array_equal(out, f32_to_bf16(want))
    dinp = start.copy()
    gelu_backward_ref(dinp, x, dout)
    want = bf16_to_f32(start)
    gelu_backward_ref(want, bf16_to_f32(x), bf16_to_f32(dout))
    np.testing.assert_array_equal(dinp, f32_to_bf16(want))
    # inputs untouched
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(dout, dout0)


def test_gelu_backward_overwrite_matches_reference_without_reading_dinp(kdev, rng):
    x, dout = rng.normal(size=(3, 70)) * 3, rng.normal(size=(3, 70))
    dinp = poisoned(kdev, x.shape)                                  # a read of dinp would leave NaN
    gelu_backward(kdev, dinp, kdev.asarray(x, np.float32), kdev.asarray(dout, np.float32), accumulate=False)
    want = np.full(x.shape, np.nan)
    gelu_backward_ref(want, x.astype(np.float32).astype(np.float64), dout.astype(np.float32).astype(np.float64),
                      accumulate=False)
    # float32 tanh and cubes: a few ulps per element
    assert rel_err(kdev.to_host(dinp), want) < 1e-6


def test_gelu_reference_backward_overwrite_is_the_accumulate_into_zeros(rng):
    x, dout = rng.normal(size=(4, 9)) * 2, rng.normal(size=(4, 9))
    over, acc = np.full(x.shape, np.nan), np.zeros(x.shape)
    gelu_backward_ref(over, x, dout, accumulate=False)
    gelu_backward_ref(acc, x, dout)
    np.testing.assert_array_equal(over, acc)
    # bf16 storage: the float32 result rounded, the poisoned dinp never read
    xb, db = f32_to_bf16(x), f32_to_bf16(dout)
    got = np.full(x.shape, 0x7FC0, np.uint16)
    gelu_backward_ref(got, xb, db, accumulate=False)
    want = np.zeros(x.shape, np.float32)
    gelu_backward_ref(want, bf16_to_f32(xb), bf16_to_f32(db))
    # equal as numbers: where float32 tanh(u) rounds to -1 (x <= -5.42) gelu' is +0, and +0 * (dout < 0) is -0,
    # which the overwrite stores and the accumulate turns into 0 + -0 = +0 (bits 0x8000 against 0x0000)
    np.testing.assert_array_equal(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(want)))


# float32 tanh(u) for u < -4 lies within 2^-24 (one float32 step below 1) of -1: 1 + tanh u and 1 - tanh^2 u,
# the factors of gelu and gelu', are then all rounding. The kernel (math.tanh: tanhf on the GPU, a float64 tanh
# rounded to float32 in the simulator) and the reference (NumPy's float32 tanh, itself up to an ulp off) may
# differ by a float32 step or two in t, and t * t rounds once more; a change dt in t moves gelu by 0.5 x dt and
# gelu' by (0.5 - x t s (1 + 3c x^2)) dt. So the two agree to an ABSOLUTE error of a few 2^-24 times those
# factors (x = -5.25, dout = 2: gelu' dout 2.3e-6 in the reference, 1.2e-6 in the kernel, 5.7e-7 exact), not
# to a fixed 1e-6 (the LLMZ_TEST_SEED=3459431758 failure). Four float32 steps of t:
TANH_STEPS = 4 * 2.0 ** -24


def gelu_forward_noise(x):
    """Per element: how far two float32 gelu(x) may be apart from the float32 rounding of tanh near +-1."""
    return TANH_STEPS * 0.5 * np.abs(x)


def gelu_backward_noise(x, dout, start=0.0):
    """Per element: the same for dinp = start + gelu'(x) dout: the tanh rounding through d(gelu')/dt, plus a
    float32 rounding of each term where start + gelu' dout cancels."""
    s, c = np.sqrt(2.0 / np.pi), 0.044715
    x = np.abs(x.astype(np.float64))
    slope = 0.5 + x * s * (1.0 + 3.0 * c * x * x)
    return TANH_STEPS * (slope * np.abs(dout) + np.abs(start))


# ---- bf16 storage -------------------------------------------------------------------------------------------
def test_gelu_forward_kernel_on_bf16_is_the_rounded_float32_kernel(kdev, rng):
    x = rand_bf16(rng, SHAPE, 2.0)
    out = poisoned_bf16(kdev, SHAPE)
    gelu_forward(kdev, out, kdev.asarray(x))
    out32 = kdev.full(SHAPE, np.nan, np.float32)
    gelu_forward(kdev, out32, kdev.asarray(bf16_to_f32(x)))
    got = kdev.to_host(out)
    # the same float32 arithmetic, one rounding at the store: bit for bit
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(out32)))
    ref = np.full(SHAPE, NAN_BF16, np.uint16)
    gelu_forward_ref(ref, x)
    # the reference groups the cube differently and has its own tanh: float32 results a few ulps apart, so
    # at most one bf16 step, or the tanh rounding's absolute noise where 1 + tanh(u) cancels (x < -4)
    assert_within_one_step(got, ref, atol=gelu_forward_noise(bf16_to_f32(x)))


def test_gelu_backward_kernel_on_bf16_is_the_rounded_float32_kernel_and_accumulates(kdev, rng):
    x, dout, start = rand_bf16(rng, 105, 2.0), rand_bf16(rng, 105), rand_bf16(rng, 105)
    dinp = kdev.asarray(start)                      # accumulates: starts random
    gelu_backward(kdev, dinp, kdev.asarray(x), kdev.asarray(dout))
    dinp32 = kdev.asarray(bf16_to_f32(start))
    gelu_backward(kdev, dinp32, kdev.asarray(bf16_to_f32(x)), kdev.asarray(bf16_to_f32(dout)))
    got = kdev.to_host(dinp)
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(dinp32)))
    ref = start.copy()
    gelu_backward_ref(ref, x, dout)
    # float32 results a few ulps apart, or the tanh rounding's absolute noise (x < -4, or start + gelu' dout
    # cancelling)
    assert_within_one_step(got, ref, atol=gelu_backward_noise(bf16_to_f32(x), bf16_to_f32(dout), bf16_to_f32(start)))


def test_gelu_backward_kernel_on_bf16_overwrites_as_the_rounded_float32_kernel(kdev, rng):
    x, dout = rand_bf16(rng, 105, 2.0), rand_bf16(rng, 105)
    dinp = poisoned_bf16(kdev, 105)                 # overwrites: a read of dinp would leave NaN
    gelu_backward(kdev, dinp, kdev.asarray(x), kdev.asarray(dout), accumulate=False)
    dinp32 = kdev.full(105, np.nan, np.float32)
    gelu_backward(kdev, dinp32, kdev.asarray(bf16_to_f32(x)), kdev.asarray(bf16_to_f32(dout)), accumulate=False)
    got = kdev.to_host(dinp)
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(dinp32)))
    ref = np.full(105, NAN_BF16, np.uint16)
    gelu_backward_ref(ref, x, dout, accumulate=False)
    # float32 results a few ulps apart: at most one bf16 step, or the tanh rounding's absolute noise (x < -4)
    assert_within_one_step(got, ref, atol=gelu_backward_noise(bf16_to_f32(x), bf16_to_f32(dout)))


def gelu_bf16_against_float32(dev, k, rng, shape):
    """The layer functions of k (llmz.kernels or llmz.fast) on bf16 arrays against the same on float32 copies of
    their values: the bf16 results are the float32 results rounded (printed: the share bit-identical)."""
    x, dout, start = rand_bf16(rng, shape, 2.0), rand_bf16(rng, shape), rand_bf16(rng, shape)
    out, out32 = poisoned_bf16(dev, shape), dev.full(shape, np.nan, np.float32)
    k.gelu_forward(dev, out, dev.asarray(x))
    k.gelu_forward(dev, out32, dev.asarray(bf16_to_f32(x)))
    assert_rounded_float32("gelu forward", dev.to_host(out), dev.to_host(out32))
    dinp, dinp32 = dev.asarray(start), dev.asarray(bf16_to_f32(start))
    k.gelu_backward(dev, dinp, dev.asarray(x), dev.asarray(dout))
    k.gelu_backward(dev, dinp32, dev.asarray(bf16_to_f32(x)), dev.asarray(bf16_to_f32(dout)))
    assert_rounded_float32("gelu backward", dev.to_host(dinp), dev.to_host(dinp32))


@pytest.mark.gpu
def test_gelu_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    gelu_bf16_against_float32(kdev, kernels, rng, (16, 1024, 4 * 768))          # the MLP's hidden activations
