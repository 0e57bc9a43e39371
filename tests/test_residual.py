"""Residual (llmz/kernels/residual.py, the teaching kernels): the kernels against the NumPy reference, the
reference against finite differences, bf16 storage. The fast kernels: tests/test_fast_residual.py."""
import numpy as np
import pytest

from helpers import (
    NAN_BF16,
    assert_rounded_float32,
    finite_diff,
    poisoned,
    poisoned_bf16,
    rand_bf16,
    rel_err,
)
from llmz import kernels
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.residual import (
    residual_backward,
    residual_backward_ref,
    residual_forward,
    residual_forward_ref,
)

SHAPE = (2, 3, 20)      # 120 elements: not a multiple of the block


def test_residual_forward_kernel_matches_reference(kdev, rng):
    a = rng.normal(size=SHAPE).astype(np.float32)
    b = rng.normal(size=SHAPE).astype(np.float32)
    out = poisoned(kdev, SHAPE)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    ref = np.empty(SHAPE, np.float32)
    residual_forward_ref(ref, a, b)
    # one correctly rounded float32 add per element: bit-exact against the float32 reference
    np.testing.assert_array_equal(kdev.to_host(out), ref)


def test_residual_backward_kernel_matches_reference_and_accumulates(kdev, rng):
    dout = rng.normal(size=SHAPE).astype(np.float32)
    # backward accumulates: start from random non-zero values
    start1 = rng.normal(size=SHAPE).astype(np.float32)
    start2 = rng.normal(size=SHAPE).astype(np.float32)
    dinp1, dinp2 = kdev.asarray(start1), kdev.asarray(start2)
    residual_backward(kdev, dinp1, dinp2, kdev.asarray(dout))
    ref1, ref2 = start1.copy(), start2.copy()
    residual_backward_ref(ref1, ref2, dout)
    # one float32 add per element: bit-exact against the float32 reference
    np.testing.assert_array_equal(kdev.to_host(dinp1), ref1)
    np.testing.assert_array_equal(kdev.to_host(dinp2), ref2)


# one thread per element: in the simulator (32-thread blocks) 5 is less than one block, 300 ten blocks with a
# ragged tail, 33 one element past a full block
@pytest.mark.parametrize("n", [5, 300, 33])
def test_residual_kernels_write_every_element_when_n_is_off_the_block_grid(kdev, rng, n):
    a, b, dout, s1, s2 = (rng.normal(size=n).astype(np.float32) for _ in range(5))
    out = poisoned(kdev, n)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    # one float32 add per element: bit-exact (a missed element stays NaN)
    np.testing.assert_array_equal(kdev.to_host(out), a + b)
    dinp1, dinp2 = kdev.asarray(s1), kdev.asarray(s2)            # accumulate: start random
    residual_backward(kdev, dinp1, dinp2, kdev.asarray(dout))
    np.testing.assert_array_equal(kdev.to_host(dinp1), s1 + dout)
    np.testing.assert_array_equal(kdev.to_host(dinp2), s2 + dout)


def test_residual_reference_backward_matches_finite_differences(rng):
    a, b, dout = (rng.normal(size=(4, 6)) for _ in range(3))

    def f(a, b):
        out = np.empty_like(a)
        residual_forward_ref(out, a, b)
        return out
    da, db = np.zeros_like(a), np.zeros_like(b)
    residual_backward_ref(da, db, dout)
    idx, g = finite_diff(lambda x: f(x, b), a, dout)
    assert rel_err(da.reshape(-1)[idx], g) <= 1e-6
    idx, g = finite_diff(lambda x: f(a, x), b, dout)
    assert rel_err(db.reshape(-1)[idx], g) <= 1e-6


def test_residual_reference_on_bf16_storage_rounds_the_float32_sums(rng):
    # uint16 arrays hold bf16 bits: one float32 add of the exact values, rounded to nearest
    a, b, dout, s1, s2 = (f32_to_bf16(rng.normal(size=SHAPE)) for _ in range(5))
    out = np.full(SHAPE, 0x7FC0, np.uint16)
    residual_forward_ref(out, a, b)
    np.testing.assert_array_equal(out, f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)))
    d1, d2 = s1.copy(), s2.copy()
    residual_backward_ref(d1, d2, dout)
    np.testing.assert_array_equal(d1, f32_to_bf16(bf16_to_f32(s1) + bf16_to_f32(dout)))
    np.testing.assert_array_equal(d2, f32_to_bf16(bf16_to_f32(s2) + bf16_to_f32(dout)))


@pytest.mark.gpu
def test_residual_kernels_match_float64_reference_at_gpt2_size(kdev, rng):
    shape = (4, 1024, 768)
    a, b, dout, start = (rng.normal(size=shape).astype(np.float32) for _ in range(4))
    out = poisoned(kdev, shape)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    dinp1, dinp2 = kdev.asarray(start), kdev.asarray(start)
    residual_backward(kdev, dinp1, dinp2, kdev.asarray(dout))
    want_out = a.astype(np.float64) + b
    want_d = start.astype(np.float64) + dout
    errs = {"out": rel_err(kdev.to_host(out), want_out),
            "dinp1": rel_err(kdev.to_host(dinp1), want_d), "dinp2": rel_err(kdev.to_host(dinp2), want_d)}
    print(f"residual {shape}: worst relative error {max(errs.values()):.2e} {errs}")
    # one float32 rounding per element
    assert max(errs.values()) < 1e-6


SHAPE3 = (3, 5, 7)                  # 105 elements


# ---- bf16 storage ---------------------------------------------------------------------------------------
def test_residual_kernels_on_bf16_match_the_bf16_reference_bit_for_bit(kdev, rng):
    a, b, dout, s1, s2 = (rand_bf16(rng, SHAPE3) for _ in range(5))
    out = poisoned_bf16(kdev, SHAPE3)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    dinp1, dinp2 = kdev.asarray(s1), kdev.asarray(s2)     # accumulate: start random
    residual_backward(kdev, dinp1, dinp2, kdev.asarray(dout))
    ref, r1, r2 = np.full(SHAPE3, NAN_BF16, np.uint16), s1.copy(), s2.copy()
    residual_forward_ref(ref, a, b)
    residual_backward_ref(r1, r2, dout)
    # one float32 add of exact bf16 values, one rounding: the reference does the same
    np.testing.assert_array_equal(kdev.to_host(out), ref)
    np.testing.assert_array_equal(kdev.to_host(dinp1), r1)
    np.testing.assert_array_equal(kdev.to_host(dinp2), r2)


def test_residual_forward_kernel_mixes_float32_and_bf16_arrays(kdev, rng):
    a = rng.normal(size=SHAPE3).astype(np.float32)          # a float32 stream plus a bf16 one, into bf16
    b = rand_bf16(rng, SHAPE3)
    out = poisoned_bf16(kdev, SHAPE3)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    ref = np.full(SHAPE3, NAN_BF16, np.uint16)
    residual_forward_ref(ref, a, b)
    np.testing.assert_array_equal(kdev.to_host(out), ref)
    np.testing.assert_array_equal(ref, f32_to_bf16(a + bf16_to_f32(b)))


def residual_bf16_against_float32(dev, k, rng, shape):
    """The layer functions of k (llmz.kernels or llmz.fast) on bf16 arrays against the same on float32 copies of
    their values: the bf16 results are the float32 results rounded."""
    a, b, dout, s1, s2 = (rand_bf16(rng, shape) for _ in range(5))
    out, out32 = poisoned_bf16(dev, shape), dev.full(shape, np.nan, np.float32)
    k.residual_forward(dev, out, dev.asarray(a), dev.asarray(b))
    k.residual_forward(dev, out32, dev.asarray(bf16_to_f32(a)), dev.asarray(bf16_to_f32(b)))
    assert_rounded_float32("residual forward", dev.to_host(out), dev.to_host(out32))
    d1, d2 = dev.asarray(s1), dev.asarray(s2)
    d1_32, d2_32 = dev.asarray(bf16_to_f32(s1)), dev.asarray(bf16_to_f32(s2))
    k.residual_backward(dev, d1, d2, dev.asarray(dout))
    k.residual_backward(dev, d1_32, d2_32, dev.asarray(bf16_to_f32(dout)))
    assert_rounded_float32("residual backward dinp1", dev.to_host(d1), dev.to_host(d1_32))
    assert_rounded_float32("residual backward dinp2", dev.to_host(d2), dev.to_host(d2_32))


@pytest.mark.gpu
def test_residual_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    residual_bf16_against_float32(kdev, kernels, rng, (16, 1024, 768))
