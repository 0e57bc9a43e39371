"""GELU: the kernel against the NumPy reference, the reference against finite differences, the paired
kernels against the scalar kernels bit for bit."""
import types

import numpy as np
import pytest

from helpers import finite_diff, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.bf16 import pair_view
from llmz.kernels.gelu import (
    ELEMS_PER_THREAD,
    elementwise_blocks,
    gelu_backward,
    gelu_backward_kernel,
    gelu_backward_pairs_kernel,
    gelu_backward_ref,
    gelu_forward,
    gelu_forward_kernel,
    gelu_forward_pairs_kernel,
    gelu_forward_ref,
    pairs_apply,
)


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


# each thread takes ELEMS_PER_THREAD = 4 elements a grid apart: in the simulator (32-thread blocks) 5 is less
# than one block, 300 is 3 blocks of 4 x 32 elements (384 slots) with a ragged tail, 4 x 32 + 1 one element
# past a full block
@pytest.mark.parametrize("n", [5, 300, ELEMS_PER_THREAD * 32 + 1])
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


# ---- the paired kernels (GPU fast path for float32 and bf16): the scalar kernels' bits ------------------
# Arrays as pair_view words: float32 as uint64, bf16 (uint16) as uint32. Launched directly (the layer
# functions take them only on a GPU). Word counts in the simulator (32-thread blocks, 4 words a thread):
# 37 words less than a block's 128, 301 three blocks with a ragged tail, 129 one word past a full block.
STORAGES = ("float32", "bf16")
WORD_COUNTS = (37, 301, 4 * 32 + 1)


def rand_storage(rng, shape, storage, scale=1.0):
    """Random normal values as float32, or rounded to bf16 bits (uint16)."""
    x = rng.normal(size=shape) * scale
    return x.astype(np.float32) if storage == "float32" else f32_to_bf16(x)


def nan_storage(dev, shape, storage):
    """An output poisoned with NaN (the bf16 quiet NaN for uint16)."""
    return dev.full(shape, np.nan, np.float32) if storage == "float32" else dev.full(shape, 0x7FC0, np.uint16)


def host_bits(dev, a) -> np.ndarray:
    """The stored bits on the host (float32 as uint32), to compare bit for bit (NaN included)."""
    a = dev.to_host(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def bits_values(bits) -> np.ndarray:
    """host_bits back to float32 values."""
    return bits.view(np.float32) if bits.dtype == np.uint32 else bf16_to_f32(bits)


def gelu_forward_both(dev, x, storage):
    """out of the scalar kernel and of the paired kernel, both started from NaN."""
    n = x.size
    out, outp = nan_storage(dev, n, storage), nan_storage(dev, n, storage)
    dev.launch(gelu_forward_kernel, elementwise_blocks(dev, n), dev.block_size, out, x, n)
    dev.launch(gelu_forward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(outp), pair_view(x), n // 2)
    return out, outp


def gelu_backward_both(dev, x, dout, start, accumulate):
    """dinp of the scalar kernel and of the paired kernel, both started from copies of `start`."""
    n = x.size
    dinp, dinpp = start.copy(), start.copy()
    dev.launch(gelu_backward_kernel, elementwise_blocks(dev, n), dev.block_size, dinp, x, dout, n, accumulate)
    dev.launch(gelu_backward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(dinpp), pair_view(x), pair_view(dout), n // 2, accumulate)
    return dinp, dinpp


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_words", WORD_COUNTS)
def test_gelu_pairs_kernels_are_the_scalar_kernels_bit_for_bit(kdev, rng, storage, n_words):
    n = 2 * n_words
    x, dout = kdev.asarray(rand_storage(rng, n, storage, 3.0)), kdev.asarray(rand_storage(rng, n, storage))
    # forward overwrites: outputs start NaN, so an unwritten element differs from the reference values
    out, outp = gelu_forward_both(kdev, x, storage)
    got = host_bits(kdev, outp)
    # the same float32 arithmetic per element, one rounding at the store: the same bits
    np.testing.assert_array_equal(got, host_bits(kdev, out))
    assert not np.isnan(bits_values(got)).any(), "NaN left in out"
    # backward accumulates into random non-zero values
    dinp, dinpp = gelu_backward_both(kdev, x, dout, kdev.asarray(rand_storage(rng, n, storage)), True)
    np.testing.assert_array_equal(host_bits(kdev, dinpp), host_bits(kdev, dinp))
    # backward overwrites from NaN (not read)
    dinp, dinpp = gelu_backward_both(kdev, x, dout, nan_storage(kdev, n, storage), False)
    got = host_bits(kdev, dinpp)
    np.testing.assert_array_equal(got, host_bits(kdev, dinp))
    assert not np.isnan(bits_values(got)).any(), "NaN left in an overwritten dinp"


def test_gelu_pairs_apply_only_to_aligned_even_float32_or_bf16_on_a_gpu(rng):
    gpu, sim = types.SimpleNamespace(kind="gpu"), types.SimpleNamespace(kind="sim")
    f32, b16 = np.zeros(10, np.float32), np.zeros(10, np.uint16)
    assert pairs_apply(gpu, f32, b16) and pairs_apply(gpu, f32.reshape(2, 5), f32)
    assert not pairs_apply(sim, f32, f32)                               # the simulator's layers: scalar
    assert not pairs_apply(gpu, np.zeros(9, np.float32), np.zeros(9, np.float32))     # odd size
    assert not pairs_apply(gpu, np.zeros(10), f32)                      # float64
    assert not pairs_apply(gpu, f32[1:9], f32[:8])                      # a view at an odd element


@pytest.mark.gpu
def test_gelu_pairs_kernels_are_the_scalar_kernels_bit_for_bit_at_d12_size(kdev, rng):
    shape = (4, 1024, 3072)                                             # B, T, 4C of d12
    for storage in STORAGES:
        x = kdev.asarray(rand_storage(rng, shape, storage, 3.0)).reshape(-1)
        dout = kdev.asarray(rand_storage(rng, shape, storage)).reshape(-1)
        out, outp = gelu_forward_both(kdev, x, storage)
        acc, accp = gelu_backward_both(kdev, x, dout, kdev.asarray(rand_storage(rng, shape, storage)).reshape(-1),
                                       True)
        over, overp = gelu_backward_both(kdev, x, dout, nan_storage(kdev, x.size, storage), False)
        for name, a, b in (("forward", outp, out), ("backward +=", accp, acc), ("backward =", overp, over)):
            same = np.mean(host_bits(kdev, a) == host_bits(kdev, b))
            print(f"gelu {name} {storage} {shape}: pairs vs scalar kernel, {same:.6%} of elements bit-identical")
            np.testing.assert_array_equal(host_bits(kdev, a), host_bits(kdev, b))
