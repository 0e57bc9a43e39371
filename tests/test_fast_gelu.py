"""GELU's fast kernels (llmz/fast/gelu.py) against the teaching kernels (llmz/kernels/gelu.py): the paired
kernels give the teaching kernels' bits, in the simulator and on the GPU at d12's size; the fast layer takes
them only for float32 / bf16 arrays of even size on a word boundary."""
import numpy as np
import pytest
from test_gelu import gelu_bf16_against_float32

import llmz.fast
from helpers import STORAGES, as_f64, bits, nan_storage, rand_storage
from llmz.fast import gelu as fast
from llmz.fast.device_helpers import elementwise_blocks, pair_view
from llmz.kernels import gelu as teaching
from llmz.kernels.grid import ceil_div

# word counts in the simulator (32-thread blocks, 4 words a thread): 37 less than a block's 128, 301 three blocks
# with a ragged tail, 129 one word past a full block
WORD_COUNTS = (37, 301, 4 * 32 + 1)


def forward_both(dev, x, storage):
    """out of the teaching kernel and of the paired kernel, both started from NaN."""
    n = x.size
    out, outp = nan_storage(dev, n, storage), nan_storage(dev, n, storage)
    dev.launch(teaching.gelu_forward_kernel, ceil_div(n, dev.block_size), dev.block_size, out, x, n)
    dev.launch(fast.gelu_forward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(outp), pair_view(x), n // 2)
    return out, outp


def backward_both(dev, x, dout, start, accumulate):
    """dinp of the teaching kernel and of the paired kernel, both started from copies of `start`."""
    n = x.size
    dinp, dinpp = start.copy(), start.copy()
    dev.launch(teaching.gelu_backward_kernel, ceil_div(n, dev.block_size), dev.block_size, dinp, x, dout, n,
               accumulate)
    dev.launch(fast.gelu_backward_pairs_kernel, elementwise_blocks(dev, n // 2), dev.block_size,
               pair_view(dinpp), pair_view(x), pair_view(dout), n // 2, accumulate)
    return dinp, dinpp


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n_words", WORD_COUNTS)
def test_gelu_pairs_kernels_are_the_teaching_kernels_bit_for_bit(kdev, rng, storage, n_words):
    n = 2 * n_words
    x, dout = kdev.asarray(rand_storage(rng, n, storage, 3.0)), kdev.asarray(rand_storage(rng, n, storage))
    # forward overwrites: outputs start NaN, so an unwritten element differs
    out, outp = forward_both(kdev, x, storage)
    got = bits(kdev.to_host(outp))
    # the same float32 arithmetic per element, one rounding at the store: the same bits
    np.testing.assert_array_equal(got, bits(kdev.to_host(out)))
    assert not np.isnan(as_f64(kdev.to_host(outp))).any(), "NaN left in out"
    # backward accumulates into random non-zero values
    dinp, dinpp = backward_both(kdev, x, dout, kdev.asarray(rand_storage(rng, n, storage)), True)
    np.testing.assert_array_equal(bits(kdev.to_host(dinpp)), bits(kdev.to_host(dinp)))
    # backward overwrites from NaN (not read)
    dinp, dinpp = backward_both(kdev, x, dout, nan_storage(kdev, n, storage), False)
    np.testing.assert_array_equal(bits(kdev.to_host(dinpp)), bits(kdev.to_host(dinp)))
    assert not np.isnan(as_f64(kdev.to_host(dinpp))).any(), "NaN left in an overwritten dinp"


# (n, dtype, start): even float32 and bf16 on a word boundary take the pairs; odd sizes, float64 and a view at an
# odd element the teaching kernel
@pytest.mark.parametrize("n, dtype, start, paired", [(40, np.float32, 0, True), (40, np.uint16, 2, True),
                                                     (39, np.float32, 0, False), (40, np.float64, 0, False),
                                                     (40, np.float32, 1, False)])
def test_gelu_fast_layer_takes_the_pairs_only_where_they_fit(fdev, rng, launched, n, dtype, start, paired):
    x = fdev.asarray(rand_storage(rng, n + 2, "bf16", 3.0) if dtype == np.uint16 else rng.normal(size=n + 2) * 3,
                     None if dtype == np.uint16 else dtype)
    out = fdev.asarray(np.zeros(n + 2, dtype))
    names = launched(fdev)
    fast.gelu_forward(fdev, out[start:start + n], x[start:start + n])
    assert names == ["gelu_forward_pairs_kernel" if paired else "gelu_forward_kernel"]
    want = np.zeros(n, np.float64)
    teaching.gelu_forward_ref(want, as_f64(fdev.to_host(x))[start:start + n])
    tol = 4e-3 if dtype == np.uint16 else 1e-6                  # one bf16 rounding; float32: a few ulps
    np.testing.assert_allclose(as_f64(fdev.to_host(out))[start:start + n], want, rtol=tol, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("C", [768, 1600])
def test_gelu_fast_layers_are_the_teaching_layers_bit_for_bit_at_gpt2_size(kdev, fdev, rng, storage, C):
    shape = (4, 1024, 4 * C)                                            # B, T, 4C of d12 and d48
    x, dout, start = (rand_storage(rng, shape, storage, s) for s in (3.0, 1.0, 1.0))
    outs = {}
    for name, dev in (("teaching", kdev), ("fast", fdev)):
        out, acc, over = nan_storage(dev, shape, storage), dev.asarray(start), nan_storage(dev, shape, storage)
        xd, dd = dev.asarray(x), dev.asarray(dout)
        (fast if dev is fdev else teaching).gelu_forward(dev, out, xd)
        (fast if dev is fdev else teaching).gelu_backward(dev, acc, xd, dd)
        (fast if dev is fdev else teaching).gelu_backward(dev, over, xd, dd, accumulate=False)
        outs[name] = [bits(dev.to_host(a)) for a in (out, acc, over)]
    for what, t, f in zip(("forward", "backward +=", "backward ="), outs["teaching"], outs["fast"]):
        print(f"gelu {what} {storage} {shape}: fast vs teaching, {np.mean(t == f):.6%} of elements bit-identical")
        np.testing.assert_array_equal(f, t)


@pytest.mark.gpu
def test_gelu_fast_bf16_kernels_match_float32_kernels_at_gpt2_size(fdev, rng):
    gelu_bf16_against_float32(fdev, llmz.fast, rng, (16, 1024, 4 * 768))
