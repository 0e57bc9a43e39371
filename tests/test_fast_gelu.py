"""GELU's fast kernels (llmz/fast/gelu.py: units of 8 elements, sig = 1 / (1 + exp(-2u)) on ex2.approx and
rcp.approx) against the float64 reference and the teaching kernels (llmz/kernels/gelu.py): float32 within 1e-6
of float64 (normwise), bf16 within one bf16 step of the teaching kernels; every element written; finite for any
finite input; the fast layer takes the units only for float32 / bf16 arrays of a size % 8 on 16 bytes."""
import numpy as np
import pytest
from test_gelu import gelu_bf16_against_float32

import llmz.fast
from helpers import STORAGES, as_f64, assert_within_one_step, nan_storage, rand_storage, rel_err
from llmz.fast import gelu as fast
from llmz.kernels import gelu as teaching

# elements in the simulator (32-thread blocks, 2 units of 8 a thread: 512 a block): 296 less than a block,
# 1544 three blocks with a ragged tail, 520 one unit past a full block
SIZES = (296, 1544, 520)


def both(dev_t, dev_f, x, dout, start, storage):
    """forward, backward +=, backward = of the teaching and the fast layers: {name: [outputs as float64]}."""
    got = {}
    for name, dev, k in (("teaching", dev_t, teaching), ("fast", dev_f, fast)):
        out, over, acc = nan_storage(dev, x.shape, storage), nan_storage(dev, x.shape, storage), dev.asarray(start)
        xd, gd = dev.asarray(x), dev.asarray(dout)
        k.gelu_forward(dev, out, xd)
        k.gelu_backward(dev, acc, xd, gd)
        k.gelu_backward(dev, over, xd, gd, accumulate=False)
        got[name] = [dev.to_host(a) for a in (out, acc, over)]
    return got


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n", SIZES)
def test_gelu_fast_layers_match_float64_and_the_teaching_layers(kdev, fdev, rng, storage, n):
    x, dout, start = (rand_storage(rng, n, storage, s) for s in (3.0, 1.0, 1.0))
    got = both(kdev, fdev, x, dout, start, storage)
    x64, g64 = as_f64(x), as_f64(dout)
    want = [np.empty(n), as_f64(start), np.empty(n)]
    teaching.gelu_forward_ref(want[0], x64)
    teaching.gelu_backward_ref(want[1], x64, g64)
    teaching.gelu_backward_ref(want[2], x64, g64, accumulate=False)
    for what, f, t, w in zip(("forward", "backward +=", "backward ="), got["fast"], got["teaching"], want):
        assert not np.isnan(as_f64(f)).any(), f"{what}: NaN left (an element not written)"
        if storage == "float32":
            # ex2.approx and rcp.approx: ~2 ulps each, a few float32 ulps in all (NumPy's exact functions here)
            assert rel_err(f, w) < 1e-6, what
        else:
            # the same value within float32 ulps, rounded once to bf16: at most a step apart
            assert_within_one_step(f, t, atol=1e-6)


def test_gelu_fast_is_finite_and_right_far_out(fdev, rng):
    # large |x|: exp(-2u) is capped (no inf * 0); gelu(x) -> 0 and x, gelu'(x) -> 0 and 1
    x = np.array([-1e4, -300, -60, -20, -5, -1e-3, 0, 1e-3, 5, 20, 60, 300, 1e4, -0.5, 0.5, 2], np.float32)
    out, d = fdev.full(16, np.nan, np.float32), fdev.full(16, np.nan, np.float32)
    fast.gelu_forward(fdev, out, fdev.asarray(x))
    fast.gelu_backward(fdev, d, fdev.asarray(x), fdev.asarray(np.ones(16, np.float32)), accumulate=False)
    want, dwant = np.empty(16), np.empty(16)
    teaching.gelu_forward_ref(want, x.astype(np.float64))
    teaching.gelu_backward_ref(dwant, x.astype(np.float64), np.ones(16), accumulate=False)
    got, dgot = fdev.to_host(out), fdev.to_host(d)
    assert np.isfinite(got).all() and np.isfinite(dgot).all()
    # in the tail (x = -5: gelu ~ -2e-7) exp's float32 argument (~ -23) carries its rounding into the result,
    # ~1e-6 relative (the teaching kernel's 1 + tanh(u) cancels there, worse); elsewhere a few ulps
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-30)
    np.testing.assert_allclose(dgot, dwant, rtol=4e-6, atol=1e-20)


# (n, dtype, start): float32 and bf16 of a size % 8 on 16 bytes take the units; other sizes, float64 and a view
# off 16 bytes the teaching kernel
@pytest.mark.parametrize("n, dtype, start, units", [(40, np.float32, 0, True), (40, np.uint16, 8, True),
                                                    (36, np.float32, 0, False), (40, np.float64, 0, False),
                                                    (40, np.float32, 2, False)])
def test_gelu_fast_layer_takes_the_units_only_where_they_fit(fdev, rng, launched, n, dtype, start, units):
    x = fdev.asarray(rand_storage(rng, n + 8, "bf16", 3.0) if dtype == np.uint16 else rng.normal(size=n + 8) * 3,
                     None if dtype == np.uint16 else dtype)
    out = fdev.asarray(np.zeros(n + 8, dtype))
    names = launched(fdev)
    fast.gelu_forward(fdev, out[start:start + n], x[start:start + n])
    assert names == ["gelu_forward_units_kernel" if units else "gelu_forward_kernel"]
    want = np.zeros(n, np.float64)
    teaching.gelu_forward_ref(want, as_f64(fdev.to_host(x))[start:start + n])
    tol = 4e-3 if dtype == np.uint16 else 1e-6                  # one bf16 rounding; float32: a few ulps
    np.testing.assert_allclose(as_f64(fdev.to_host(out))[start:start + n], want, rtol=tol, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("C", [768, 1600])
def test_gelu_fast_layers_at_gpt2_size(kdev, fdev, rng, storage, C):
    shape = (4, 1024, 4 * C)                                            # B, T, 4C of d12 and d48
    x, dout, start = (rand_storage(rng, shape, storage, s) for s in (3.0, 1.0, 1.0))
    got = both(kdev, fdev, x, dout, start, storage)
    for what, f, t in zip(("forward", "backward +=", "backward ="), got["fast"], got["teaching"]):
        print(f"gelu {what} {storage} {shape}: fast vs teaching, {np.mean(f == t):.4%} of elements bit-identical, "
              f"relative difference {rel_err(as_f64(f), as_f64(t)):.2e}")
        if storage == "float32":
            assert rel_err(f, t) < 1e-6, what
        else:
            assert_within_one_step(f, t, atol=1e-6)


@pytest.mark.gpu
def test_gelu_fast_bf16_kernels_match_float32_kernels_at_gpt2_size(fdev, rng):
    gelu_bf16_against_float32(fdev, llmz.fast, rng, (16, 1024, 4 * 768))
