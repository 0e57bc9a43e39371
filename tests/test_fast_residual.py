"""The residual's fast kernels (llmz/fast/residual.py) against the teaching kernels (llmz/kernels/residual.py):
the paired kernels give the teaching kernels' bits, in the simulator and on the GPU at d12's size."""
import numpy as np
import pytest
from test_fast_gelu import WORD_COUNTS
from test_residual import residual_bf16_against_float32

import llmz.fast
from helpers import STORAGES, bits, nan_storage, rand_storage
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.fast import residual as fast
from llmz.fast.device_helpers import elementwise_blocks, pair_view
from llmz.kernels import residual as teaching
from llmz.kernels.grid import ceil_div


def forward_both(dev, a, b, out_storage):
    """out of the teaching kernel and of the paired kernel, both started from NaN."""
    n = a.size
    out, outp = nan_storage(dev, n, out_storage), nan_storage(dev, n, out_storage)
    dev.launch(teaching.residual_forward_kernel, ceil_div(n, dev.block_size), dev.block_size, out, a, b, n)
    dev.launch(fast.residual_forward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(outp), pair_view(a), pair_view(b), n // 2)
    return out, outp


def backward_both(dev, s1, s2, dout):
    """(dinp1, dinp2) of the teaching kernel and of the paired kernel, each started from copies of s1, s2."""
    n = dout.size
    d1, d2, d1p, d2p = s1.copy(), s2.copy(), s1.copy(), s2.copy()
    dev.launch(teaching.residual_backward_kernel, ceil_div(n, dev.block_size), dev.block_size, d1, d2, dout, n)
    dev.launch(fast.residual_backward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(d1p), pair_view(d2p), pair_view(dout), n // 2)
    return (d1, d2), (d1p, d2p)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_words", WORD_COUNTS)
def test_residual_pairs_kernels_are_the_teaching_kernels_bit_for_bit(kdev, rng, storage, n_words):
    n = 2 * n_words
    a, b, dout, s1, s2 = (kdev.asarray(rand_storage(rng, n, storage)) for _ in range(5))
    # forward overwrites: outputs start NaN; the same float32 add and rounding per element: the same bits
    out, outp = forward_both(kdev, a, b, storage)
    np.testing.assert_array_equal(bits(kdev.to_host(outp)), bits(kdev.to_host(out)))
    # backward accumulates into random non-zero values
    teaching_d, paired_d = backward_both(kdev, s1, s2, dout)
    for want, got in zip(teaching_d, paired_d):
        np.testing.assert_array_equal(bits(kdev.to_host(got)), bits(kdev.to_host(want)))


def test_residual_forward_pairs_kernel_mixes_float32_and_bf16_words(kdev, rng):
    # a float32 stream (uint64 words) plus a bf16 one (uint32 words) into bf16: word w is elements 2w, 2w+1
    # in both views
    a, b = (kdev.asarray(rand_storage(rng, 2 * 37, s)) for s in STORAGES)
    out, outp = forward_both(kdev, a, b, "bf16")
    np.testing.assert_array_equal(kdev.to_host(outp), kdev.to_host(out))
    np.testing.assert_array_equal(kdev.to_host(outp), f32_to_bf16(kdev.to_host(a) + bf16_to_f32(kdev.to_host(b))))


def test_residual_fast_layer_takes_the_pairs_for_even_aligned_arrays(fdev, rng, launched):
    a, b = (fdev.asarray(rng.normal(size=41), np.float32) for _ in range(2))
    out = fdev.full(41, np.nan, np.float32)
    names = launched(fdev)
    fast.residual_forward(fdev, out[:40], a[:40], b[:40])          # even, aligned: the pairs
    fast.residual_forward(fdev, out[1:], a[1:], b[1:])             # a view at an odd element: the teaching kernel
    assert names == ["residual_forward_pairs_kernel", "residual_forward_kernel"]
    np.testing.assert_array_equal(fdev.to_host(out), fdev.to_host(a) + fdev.to_host(b))


@pytest.mark.gpu
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("C", [768, 1600])
def test_residual_fast_layers_are_the_teaching_layers_bit_for_bit_at_gpt2_size(kdev, fdev, rng, storage, C):
    shape = (4, 1024, C)                                                # B, T, C of d12 and d48
    a, b, dout, s1, s2 = (rand_storage(rng, shape, storage) for _ in range(5))
    outs = {}
    for name, dev, k in (("teaching", kdev, teaching), ("fast", fdev, fast)):
        out, d1, d2 = nan_storage(dev, shape, storage), dev.asarray(s1), dev.asarray(s2)
        k.residual_forward(dev, out, dev.asarray(a), dev.asarray(b))
        k.residual_backward(dev, d1, d2, dev.asarray(dout))
        outs[name] = [bits(dev.to_host(x)) for x in (out, d1, d2)]
    for what, t, f in zip(("forward", "backward dinp1", "backward dinp2"), outs["teaching"], outs["fast"]):
        print(f"residual {what} {storage} {shape}: fast vs teaching, {np.mean(t == f):.6%} bit-identical")
        np.testing.assert_array_equal(f, t)


@pytest.mark.gpu
def test_residual_fast_bf16_kernels_match_float32_kernels_at_gpt2_size(fdev, rng):
    residual_bf16_against_float32(fdev, llmz.fast, rng, (16, 1024, 768))
