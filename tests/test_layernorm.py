"""LayerNorm (llmz/kernels/layernorm.py, the teaching kernels): the kernels against the NumPy reference, the
reference against finite differences, bf16 storage (mean and rstd stay float32). The fast kernels:
tests/test_fast_layernorm.py."""
import time

import numpy as np
import pytest

from helpers import (
    NAN_BF16,
    assert_rounded_float32,
    assert_within_one_step,
    finite_diff,
    poisoned,
    poisoned_bf16,
    rel_err,
)
from llmz import kernels
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.layernorm import (
    layernorm_backward,
    layernorm_backward_ref,
    layernorm_forward,
    layernorm_forward_ref,
)


def make_inputs(rng, shape):
    """inp with a non-zero mean and non-unit spread per row; weight around 1, bias around 0."""
    C = shape[-1]
    inp = rng.normal(size=shape) * rng.uniform(0.5, 3.0, size=shape[:-1] + (1,)) + rng.normal(size=shape[:-1] + (1,))
    return inp, 1.0 + 0.3 * rng.normal(size=C), 0.3 * rng.normal(size=C)


def forward64(inp, weight, bias):
    """The float64 reference forward: (out, mean, rstd)."""
    out = np.empty_like(inp)
    mean = np.empty(inp.shape[:-1])
    rstd = np.empty(inp.shape[:-1])
    layernorm_forward_ref(out, mean, rstd, inp, weight, bias)
    return out, mean, rstd


# (2,3,20): C below the simulator's 32-thread block; (5,45): 2-D rows, C not a multiple of the block
@pytest.mark.parametrize("shape", [(2, 3, 20), (5, 45)])
def test_layernorm_forward_kernel_matches_reference(kdev, rng, shape):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    out = poisoned(kdev, shape)
    mean = poisoned(kdev, shape[:-1])
    rstd = poisoned(kdev, shape[:-1])
    layernorm_forward(kdev, out, mean, rstd, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = forward64(inp.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64))
    # the kernel sums in float64; what is left is the float32 rounding of inputs' products and of the stores
    for got, want in zip((out, mean, rstd), ref):
        assert rel_err(kdev.to_host(got), want) < 1e-6


# (17,45): odd rows, C above the simulator's 32-thread block (the params kernel's second block of channels)
@pytest.mark.parametrize("shape", [(2, 3, 20), (5, 45), (17, 45)])
def test_layernorm_backward_kernel_matches_reference_and_accumulates(kdev, rng, shape):
    C = shape[-1]
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=shape)
    # backward accumulates: start every gradient from random non-zero values
    dinp0, dweight0, dbias0 = rng.normal(size=shape), rng.normal(size=C), rng.normal(size=C)
    # both sides see the same float32-representable inputs
    inp, weight, mean, rstd, dout = (a.astype(np.float32) for a in (inp, weight, mean, rstd, dout))
    dinp = kdev.asarray(dinp0, np.float32)
    dweight = kdev.asarray(dweight0, np.float32)
    dbias = kdev.asarray(dbias0, np.float32)
    layernorm_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout), kdev.asarray(inp), kdev.asarray(weight),
                       kdev.asarray(mean), kdev.asarray(rstd))
    ref = [dinp0.copy(), dweight0.copy(), dbias0.copy()]
    layernorm_backward_ref(*ref, *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # float64 sums in the kernel; float32 products (weight*dout, norm) and stores: a few ulps per element
    for got, want in zip((dinp, dweight, dbias), ref):
        assert rel_err(kdev.to_host(got), want) < 1e-6


def test_layernorm_backward_kernel_gives_the_same_bits_twice(kdev, rng):
    shape = (17, 45)
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    args = [kdev.asarray(a, np.float32) for a in (rng.normal(size=shape), inp, weight, mean, rstd)]
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, 45, 45)]
    got = []
    for _ in range(2):
        grads = [kdev.asarray(a) for a in starts]
        layernorm_backward(kdev, *grads, *args)
        got.append([kdev.to_host(g) for g in grads])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_layernorm_reference_backward_matches_finite_differences(rng):
    shape = (2, 3, 20)
    inp, weight, bias = make_inputs(rng, shape)
    dout = rng.normal(size=shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dinp, dweight, dbias = np.zeros(shape), np.zeros(20), np.zeros(20)
    layernorm_backward_ref(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    # out as a function of each input in turn (mean and rstd are recomputed, so they carry gradient too)
    checks = [(inp, dinp, lambda x: forward64(x, weight, bias)[0]),
              (weight, dweight, lambda w: forward64(inp, w, bias)[0]),
              (bias, dbias, lambda b: forward64(inp, weight, b)[0])]
    for x, grad, f in checks:
        idx, g = finite_diff(f, x, dout)
        assert rel_err(grad.reshape(-1)[idx], g) <= 1e-6


def test_layernorm_reference_accepts_2d_rows_like_3d(rng):
    inp, weight, bias = make_inputs(rng, (2, 3, 20))
    out3, mean3, rstd3 = forward64(inp, weight, bias)
    out2, mean2, rstd2 = forward64(inp.reshape(6, 20), weight, bias)
    np.testing.assert_array_equal(out2, out3.reshape(6, 20))
    np.testing.assert_array_equal(mean2, mean3.reshape(6))
    np.testing.assert_array_equal(rstd2, rstd3.reshape(6))


@pytest.mark.gpu
def test_layernorm_kernels_match_float64_reference_at_gpt2_size(kdev, rng):
    B, T, C = 16, 1024, 768
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (B, T, C)))
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    out, mean, rstd = poisoned(kdev, (B, T, C)), poisoned(kdev, (B, T)), poisoned(kdev, (B, T))
    layernorm_forward(kdev, out, mean, rstd, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = forward64(inp.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64))
    errs = {name: rel_err(kdev.to_host(a), r) for name, a, r in zip(("out", "mean", "rstd"), (out, mean, rstd), ref)}
    # backward from zero gradients, on the kernel's own float32 mean and rstd
    mean_h, rstd_h = kdev.to_host(mean), kdev.to_host(rstd)
    dinp, dweight, dbias = kdev.zeros((B, T, C)), kdev.zeros(C), kdev.zeros(C)
    layernorm_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout), kdev.asarray(inp), kdev.asarray(weight),
                       mean, rstd)
    want = [np.zeros((B, T, C)), np.zeros(C), np.zeros(C)]
    layernorm_backward_ref(*want, *(a.astype(np.float64) for a in (dout, inp, weight, mean_h, rstd_h)))
    errs.update({name: rel_err(kdev.to_host(a), r)
                 for name, a, r in zip(("dinp", "dweight", "dbias"), (dinp, dweight, dbias), want)})
    # timing of backward, after compilation (the two launches: rows, then dweight/dbias)
    reps = 20
    args = [kdev.asarray(a) for a in (dout, inp, weight)]
    kdev.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        layernorm_backward(kdev, dinp, dweight, dbias, *args, mean, rstd)
    kdev.synchronize()
    ms = (time.perf_counter() - t0) / reps * 1e3
    print(f"layernorm B={B} T={T} C={C}: worst relative error {max(errs.values()):.2e} {errs}; "
          f"backward {ms:.3f} ms per call")
    # float32 storage, float64 sums (16384 rows for dweight, dbias): well inside 1e-5
    assert max(errs.values()) < 1e-5


# ---- bf16 storage ----------------------------------------------------------------------------------
def nan32(dev, shape):
    """A float32 output (mean, rstd, losses) filled with NaN."""
    return dev.full(shape, np.nan, np.float32)


def widen(bits):
    """Host uint16 bits -> float32 values (exact): the float32 kernel's inputs."""
    return bf16_to_f32(bits)


# ---- LayerNorm ----------------------------------------------------------------------------------------
def ln_inputs(rng, shape):
    """inp, weight, bias rounded to bf16 bits (a non-zero mean and non-unit spread per row)."""
    return tuple(f32_to_bf16(a) for a in make_inputs(rng, shape))


def ln_grads(rng, shape):
    """dout and the starting dinp, dweight, dbias (accumulated into: random, never zero), as bf16 bits."""
    C = shape[-1]
    return tuple(f32_to_bf16(rng.normal(size=s)) for s in (shape, shape, C, C))


def ln_forward_both(dev, inp, weight, bias, launch):
    """launch(out, mean, rstd, inp, weight, bias) on the bf16 bits and on their float32 values, into poisoned
    outputs: (out bits, mean, rstd), (out32, mean32, rstd32) on the host."""
    shape = inp.shape
    outs = []
    for conv, out in ((lambda a: a, poisoned_bf16(dev, shape)), (widen, nan32(dev, shape))):
        mean, rstd = nan32(dev, shape[:-1]), nan32(dev, shape[:-1])
        launch(out, mean, rstd, *(dev.asarray(conv(a)) for a in (inp, weight, bias)))
        outs.append([dev.to_host(a) for a in (out, mean, rstd)])
    return outs


def assert_ln_forward(got, want32, inp, weight, bias):
    out, mean, rstd = got
    out32, mean32, rstd32 = want32
    # the float32 kernel's result, rounded once; mean and rstd stay float32, the float32 kernel's bits
    np.testing.assert_array_equal(out, f32_to_bf16(out32))
    assert mean.dtype == np.float32 and rstd.dtype == np.float32
    np.testing.assert_array_equal(mean, mean32)
    np.testing.assert_array_equal(rstd, rstd32)
    ref = np.full(inp.shape, NAN_BF16, np.uint16), np.empty(inp.shape[:-1], np.float32), \
        np.empty(inp.shape[:-1], np.float32)
    layernorm_forward_ref(*ref, inp, weight, bias)
    # the reference sums in float32 (NumPy's pairwise order), the kernel in float64: float32 results a few
    # ulps apart, one bf16 step at most (1e-5 absolute where x_i - mean cancels)
    assert_within_one_step(out, ref[0], atol=1e-5)
    assert rel_err(mean, ref[1]) < 1e-6 and rel_err(rstd, ref[2]) < 1e-6


# (5,45): C not a multiple of the 32-thread block, 2-D rows; (2,3,20): C below the block, 3-D
@pytest.mark.parametrize("shape", [(5, 45), (2, 3, 20)])
def test_layernorm_forward_kernel_on_bf16_is_the_rounded_float32_kernel(kdev, rng, shape):
    inp, weight, bias = ln_inputs(rng, shape)
    got, want32 = ln_forward_both(kdev, inp, weight, bias,
                                  lambda *a: layernorm_forward(kdev, *a))
    assert_ln_forward(got, want32, inp, weight, bias)


def ln_backward_both(dev, shape, dout, inp, weight, starts, mean, rstd, launch):
    """launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd) from the same starting gradients, in bf16 and
    on their float32 values (mean, rstd: float32 both times): the gradients' bits and float32 values."""
    outs = []
    for conv in (lambda a: a, widen):
        grads = [dev.asarray(conv(a)) for a in starts]
        launch(*grads, *(dev.asarray(conv(a)) for a in (dout, inp, weight)), dev.asarray(mean), dev.asarray(rstd))
        outs.append([dev.to_host(g) for g in grads])
    return outs


def ln_stats(inp, weight, bias):
    """float32 mean and rstd of the bf16 rows (the reference on their values)."""
    mean, rstd = np.empty(inp.shape[:-1], np.float32), np.empty(inp.shape[:-1], np.float32)
    layernorm_forward_ref(np.empty(inp.shape, np.float32), mean, rstd, widen(inp), widen(weight), widen(bias))
    return mean, rstd


# (11,45): C above the simulator's 32-thread block
def test_layernorm_backward_kernels_on_bf16_are_the_rounded_float32_kernels_and_accumulate(kdev, rng):
    shape = (11, 45)
    inp, weight, bias = ln_inputs(rng, shape)
    mean, rstd = ln_stats(inp, weight, bias)
    dout, *starts = ln_grads(rng, shape)
    got, want32 = ln_backward_both(kdev, shape, dout, inp, weight, starts, mean, rstd,
                                   lambda *a: layernorm_backward(kdev, *a))
    # rows kernel (dinp) and params kernel (dweight, dbias): the float32 kernels' results, rounded once
    for g, w in zip(got, want32):
        np.testing.assert_array_equal(g, f32_to_bf16(w))
    ref = [s.copy() for s in starts]
    layernorm_backward_ref(*ref, dout, inp, weight, mean, rstd)
    # float32 sums in the reference (11 rows for dweight, dbias; 45 channels for dinp's means), float64 in the
    # kernels: within one bf16 step, or 1e-4 absolute where start + gradient cancels to near zero
    for g, r in zip(got, ref):
        assert_within_one_step(g, r, atol=1e-4)


def test_layernorm_forward_mixes_bf16_activations_and_float32_parameters(kdev, rng):
    shape = (5, 45)
    inp, weight, bias = ln_inputs(rng, shape)
    w32, b32 = widen(weight), widen(bias)               # float32 parameters: the same values
    out, mean, rstd = poisoned_bf16(kdev, shape), nan32(kdev, 5), nan32(kdev, 5)
    layernorm_forward(kdev, out, mean, rstd, kdev.asarray(inp), kdev.asarray(w32), kdev.asarray(b32))
    out32, mean32, rstd32 = nan32(kdev, shape), nan32(kdev, 5), nan32(kdev, 5)
    layernorm_forward(kdev, out32, mean32, rstd32, *(kdev.asarray(widen(a)) for a in (inp, weight, bias)))
    # the same values whichever storage the parameters have: the float32 kernel's bits, out rounded once
    np.testing.assert_array_equal(kdev.to_host(out), f32_to_bf16(kdev.to_host(out32)))
    np.testing.assert_array_equal(kdev.to_host(mean), kdev.to_host(mean32))
    np.testing.assert_array_equal(kdev.to_host(rstd), kdev.to_host(rstd32))


def assert_float32_close(name, got, want, rel=1e-6):
    err = np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    print(f"{name}: worst relative error per element {err.max():.3e}; {np.mean(got == want):.4%} bit-identical")
    assert err.max() <= rel


def layernorm_bf16_against_float32(dev, k, rng, N, C):
    """The layer functions of k (llmz.kernels or llmz.fast) on bf16 arrays against the same on float32 copies of
    their values: the bf16 results rounded float32 ones, mean and rstd (float32) within 1e-6."""
    kdev = dev
    inp, weight, bias = ln_inputs(rng, (N, C))
    (out, mean, rstd), (out32, mean32, rstd32) = ln_forward_both(kdev, inp, weight, bias,
                                                                 lambda *a: k.layernorm_forward(kdev, *a))
    assert_rounded_float32("layernorm forward out", out, out32)
    assert_float32_close("layernorm forward mean", mean, mean32)
    assert_float32_close("layernorm forward rstd", rstd, rstd32)
    # backward from the float32 kernel's statistics, into random bf16 gradients (small: as in training)
    dout, dinp0, dw0, db0 = ln_grads(rng, (N, C))
    starts = [dinp0, f32_to_bf16(widen(dw0) * 1e-2), f32_to_bf16(widen(db0) * 1e-2)]
    got, want32 = ln_backward_both(kdev, (N, C), dout, inp, weight, starts, mean32, rstd32,
                                   lambda *a: k.layernorm_backward(kdev, *a))
    for name, g, w in zip(("dinp", "dweight", "dbias"), got, want32):
        assert_rounded_float32(f"layernorm backward {name}", g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (4096, 1600)])      # d12's rows and channels; d48's channels
def test_layernorm_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng, N, C):
    layernorm_bf16_against_float32(kdev, kernels, rng, N, C)
