"""Residual: the kernels against the NumPy reference, the reference against finite differences, the paired
kernels against the scalar kernels bit for bit."""
import numpy as np
import pytest
from test_gelu import STORAGES, WORD_COUNTS, bits_values, host_bits, nan_storage, rand_storage

from helpers import finite_diff, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.bf16 import pair_view
from llmz.kernels.gelu import ELEMS_PER_THREAD, elementwise_blocks
from llmz.kernels.residual import (
    residual_backward,
    residual_backward_kernel,
    residual_backward_pairs_kernel,
    residual_backward_ref,
    residual_forward,
    residual_forward_kernel,
    residual_forward_pairs_kernel,
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


# each thread takes ELEMS_PER_THREAD = 4 elements a grid apart: in the simulator (32-thread blocks) 5 is less
# than one block, 300 is 3 blocks of 4 x 32 elements (384 slots) with a ragged tail, 4 x 32 + 1 one element
# past a full block
@pytest.mark.parametrize("n", [5, 300, ELEMS_PER_THREAD * 32 + 1])
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


# ---- the paired kernels (GPU fast path for float32 and bf16): the scalar kernels' bits ------------------
# pair_view words launched directly; word counts as in test_gelu (off the simulator's block grid)
def residual_forward_both(dev, a, b, out_storage):
    """out of the scalar kernel and of the paired kernel, both started from NaN."""
    n = a.size
    out, outp = nan_storage(dev, n, out_storage), nan_storage(dev, n, out_storage)
    dev.launch(residual_forward_kernel, elementwise_blocks(dev, n), dev.block_size, out, a, b, n)
    dev.launch(residual_forward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(outp), pair_view(a), pair_view(b), n // 2)
    return out, outp


def residual_backward_both(dev, s1, s2, dout):
    """(dinp1, dinp2) of the scalar kernel and of the paired kernel, each started from copies of s1, s2."""
    n = dout.size
    d1, d2, d1p, d2p = s1.copy(), s2.copy(), s1.copy(), s2.copy()
    dev.launch(residual_backward_kernel, elementwise_blocks(dev, n), dev.block_size, d1, d2, dout, n)
    dev.launch(residual_backward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(d1p), pair_view(d2p), pair_view(dout), n // 2)
    return (d1, d2), (d1p, d2p)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_words", WORD_COUNTS)
def test_residual_pairs_kernels_are_the_scalar_kernels_bit_for_bit(kdev, rng, storage, n_words):
    n = 2 * n_words
    a, b, dout, s1, s2 = (kdev.asarray(rand_storage(rng, n, storage)) for _ in range(5))
    # forward overwrites: outputs start NaN; the same float32 add and rounding per element: the same bits
    out, outp = residual_forward_both(kdev, a, b, storage)
    got = host_bits(kdev, outp)
    np.testing.assert_array_equal(got, host_bits(kdev, out))
    assert not np.isnan(bits_values(got)).any(), "NaN left in out"
    # backward accumulates into random non-zero values
    scalar, paired = residual_backward_both(kdev, s1, s2, dout)
    for want, got in zip(scalar, paired):
        np.testing.assert_array_equal(host_bits(kdev, got), host_bits(kdev, want))


def test_residual_forward_pairs_kernel_mixes_float32_and_bf16_words(kdev, rng):
    # a float32 stream (uint64 words) plus a bf16 one (uint32 words) into bf16: word w is elements 2w, 2w+1
    # in both views
    a, b = (kdev.asarray(rand_storage(rng, 2 * 37, s)) for s in STORAGES)
    out, outp = residual_forward_both(kdev, a, b, "bf16")
    np.testing.assert_array_equal(kdev.to_host(outp), kdev.to_host(out))
    np.testing.assert_array_equal(kdev.to_host(outp), f32_to_bf16(kdev.to_host(a) + bf16_to_f32(kdev.to_host(b))))


@pytest.mark.gpu
def test_residual_pairs_kernels_are_the_scalar_kernels_bit_for_bit_at_d12_size(kdev, rng):
    shape = (4, 1024, 768)                                              # B, T, C of d12
    for storage in STORAGES:
        a, b, dout, s1, s2 = (kdev.asarray(rand_storage(rng, shape, storage)).reshape(-1) for _ in range(5))
        out, outp = residual_forward_both(kdev, a, b, storage)
        (d1, d2), (d1p, d2p) = residual_backward_both(kdev, s1, s2, dout)
        for name, got, want in (("forward", outp, out), ("backward dinp1", d1p, d1), ("backward dinp2", d2p, d2)):
            same = np.mean(host_bits(kdev, got) == host_bits(kdev, want))
            print(f"residual {name} {storage} {shape}: pairs vs scalar kernel, {same:.6%} of elements bit-identical")
            np.testing.assert_array_equal(host_bits(kdev, got), host_bits(kdev, want))
