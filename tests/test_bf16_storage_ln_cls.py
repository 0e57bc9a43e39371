"""bf16 activations stored as uint16 bits in LayerNorm and the classifier: every kernel of llmz.kernels.layernorm
and llmz.kernels.classifier with uint16 inputs and outputs, in the simulator (the warp-per-row LayerNorm kernels
with test_layernorm's emulated shuffle), and on a GPU at GPT-2 size.

Statistics and losses stay float: mean and rstd are float32 arrays beside bf16 activations, losses too.

Each kernel is checked twice: against the same kernel on float32 copies of the bf16 inputs, its bf16 outputs
rounded to nearest, bit for bit (the uint16 specialisation does the float32 path's arithmetic and rounds at the
store; its float32 outputs, mean, rstd and losses, are the float32 kernel's bits), and against the NumPy
reference's bf16 path (llmz.bf16.run_in_f32): within one bf16 step, as the reference sums in another order
and in float32 where the kernels sum in float64."""
import numpy as np
import pytest
from test_bf16_storage import NAN_BF16, assert_rounded_float32, assert_within_one_step, poisoned_bf16
from test_layernorm import WARP_KERNELS, make_inputs, warp_geometry, wdev  # noqa: F401  (wdev: emulated shuffles)

from helpers import rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.device import ceil_div
from llmz.kernels.classifier import (
    classifier_backward,
    classifier_backward_kernel,
    classifier_backward_ref,
    classifier_backward_rows_kernel,
    classifier_forward,
    classifier_forward_online_kernel,
    classifier_forward_ref,
)
from llmz.kernels.layernorm import (
    layernorm_backward,
    layernorm_backward_ref,
    layernorm_forward,
    layernorm_forward_ref,
)


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


# (11,45): dweight, dbias in two row chunks (8 rows each in the simulator), the last one partial
def test_layernorm_backward_kernels_on_bf16_are_the_rounded_float32_kernels_and_accumulate(kdev, rng):
    shape = (11, 45)
    inp, weight, bias = ln_inputs(rng, shape)
    mean, rstd = ln_stats(inp, weight, bias)
    dout, *starts = ln_grads(rng, shape)
    got, want32 = ln_backward_both(kdev, shape, dout, inp, weight, starts, mean, rstd,
                                   lambda *a: layernorm_backward(kdev, *a))
    # rows kernel (dinp) and both params stages (dweight, dbias): the float32 kernels' results, rounded once
    for g, w in zip(got, want32):
        np.testing.assert_array_equal(g, f32_to_bf16(w))
    ref = [s.copy() for s in starts]
    layernorm_backward_ref(*ref, dout, inp, weight, mean, rstd)
    # float32 sums in the reference (11 rows for dweight, dbias; 45 channels for dinp's means), float64 in the
    # kernels: within one bf16 step, or 1e-4 absolute where start + gradient cancels to near zero
    for g, r in zip(got, ref):
        assert_within_one_step(g, r, atol=1e-4)


# odd rows: the last block's second warp has no row; the register kernels (C <= 1024) and the loop kernels
@pytest.mark.parametrize("kind", ["registers", "loop"])
@pytest.mark.parametrize("shape", [(7, 45)])
def test_layernorm_warp_kernels_on_bf16_are_the_rounded_float32_kernels(wdev, rng, shape, kind):  # noqa: F811
    forward_kernel, backward_kernel = WARP_KERNELS[kind]
    inp, weight, bias = ln_inputs(rng, shape)
    geometry = warp_geometry(wdev, shape[0])
    got, want32 = ln_forward_both(wdev, inp, weight, bias,
                                  lambda *a: wdev.launch(forward_kernel, *geometry, *a))
    assert_ln_forward(got, want32, inp, weight, bias)
    # backward, rows part: accumulates into dinp (random start)
    mean, rstd = ln_stats(inp, weight, bias)
    dout, dinp0 = ln_grads(rng, shape)[:2]
    outs = []
    for conv in (lambda a: a, widen):
        dinp = wdev.asarray(conv(dinp0))
        wdev.launch(backward_kernel, *geometry, dinp,
                    *(wdev.asarray(conv(a)) for a in (dout, inp, weight)), wdev.asarray(mean), wdev.asarray(rstd))
        outs.append(wdev.to_host(dinp))
    np.testing.assert_array_equal(outs[0], f32_to_bf16(outs[1]))
    ref = dinp0.copy()
    layernorm_backward_ref(ref, np.zeros(shape[1], np.float32), np.zeros(shape[1], np.float32),
                           dout, inp, weight, mean, rstd)
    assert_within_one_step(outs[0], ref, atol=1e-4)


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


# ---- classifier ---------------------------------------------------------------------------------------
def cls_inputs(rng, rows, V, Vp):
    """bf16 logits (rows, Vp), spread ~3 (padded columns random too: they must not matter); int32 targets."""
    return f32_to_bf16(rng.normal(size=(rows, Vp)) * 3), rng.integers(0, V, size=rows).astype(np.int32)


def cls_forward_both(dev, logits, targets, launch):
    """launch(losses, probs, logits, targets) on the bf16 bits and on their float32 values, into poisoned
    outputs (losses float32 both times): (losses, probs bits), (losses32, probs32)."""
    rows, Vp = logits.shape
    t = dev.asarray(targets)
    outs = []
    for conv, probs in ((lambda a: a, poisoned_bf16(dev, (rows, Vp))), (widen, nan32(dev, (rows, Vp)))):
        losses = nan32(dev, rows)
        launch(losses, probs, dev.asarray(conv(logits)), t)
        outs.append((dev.to_host(losses), dev.to_host(probs)))
    return outs


def assert_cls_forward(got, want32, logits, targets, V):
    (losses, probs), (losses32, probs32) = got, want32
    np.testing.assert_array_equal(probs, f32_to_bf16(probs32))
    assert losses.dtype == np.float32
    np.testing.assert_array_equal(losses, losses32)
    assert np.all(probs[:, V:] == 0)                    # padded columns: +0.0
    ref_losses, ref_probs = np.empty(len(targets), np.float32), np.full(logits.shape, NAN_BF16, np.uint16)
    classifier_forward_ref(ref_losses, ref_probs, logits, targets, V)
    # the reference in float32 (exp, sum), the kernels' sums in float64: probs a few float32 ulps apart, one
    # bf16 step at most; losses: float32 log and sums, a few ulps
    assert_within_one_step(probs, ref_probs)
    assert rel_err(losses, ref_losses) < 1e-6


# (6,50,64): two sim blocks' worth of columns, V % 32 != 0; (7,100,131): Vp not a multiple of the block
@pytest.mark.parametrize("rows, V, Vp", [(6, 50, 64), (7, 100, 131)])
def test_classifier_forward_kernel_on_bf16_is_the_rounded_float32_kernel(kdev, rng, rows, V, Vp):
    logits, targets = cls_inputs(rng, rows, V, Vp)
    got, want32 = cls_forward_both(kdev, logits, targets, lambda *a: classifier_forward(kdev, *a, V))
    assert_cls_forward(got, want32, logits, targets, V)


@pytest.mark.parametrize("order", ["random", "rising"])   # rising: every column rescales the running sum
def test_classifier_forward_online_kernel_on_bf16_is_the_rounded_float32_kernel(kdev, rng, order):
    rows, V, Vp = 7, 100, 131
    logits, targets = cls_inputs(rng, rows, V, Vp)
    if order == "rising":
        logits[:, :V] = f32_to_bf16(np.sort(widen(logits[:, :V]), axis=1))

    def launch(losses, probs, x, t):
        kdev.launch(classifier_forward_online_kernel, rows, kdev.block_size, losses, probs, x, t, V)
    got, want32 = cls_forward_both(kdev, logits, targets, launch)
    assert_cls_forward(got, want32, logits, targets, V)


def test_classifier_backward_kernels_on_bf16_overwrite_logits_in_place_as_the_rounded_float32_kernels(kdev, rng):
    rows, V, Vp = 6, 50, 64
    logits, targets = cls_inputs(rng, rows, V, Vp)
    probs = np.full((rows, Vp), NAN_BF16, np.uint16)
    classifier_forward_ref(np.empty(rows, np.float32), probs, logits, targets, V)
    probs[:, V:] = f32_to_bf16(rng.random(size=(rows, Vp - V)))     # padded columns must not leak into dlogits
    t, dloss = kdev.asarray(targets), 1.0 / rows
    # dlogits IS the logits buffer (bf16), overwritten in place: the teaching kernel (flat) and the rows kernel
    got = {}
    for name in ("flat", "rows"):
        for conv in (lambda a: a, widen):
            x, p = kdev.asarray(conv(logits)), kdev.asarray(conv(probs))
            if name == "flat":
                kdev.launch(classifier_backward_kernel, ceil_div(rows * Vp, kdev.block_size), kdev.block_size,
                            x.reshape(-1), p.reshape(-1), t, dloss, V, Vp, rows * Vp)
            else:
                kdev.launch(classifier_backward_rows_kernel, (rows, ceil_div(Vp, kdev.block_size)),
                            kdev.block_size, x, p, t, dloss, V)
            got.setdefault(name, []).append(kdev.to_host(x))
    for name, (bits, f32) in got.items():
        np.testing.assert_array_equal(bits, f32_to_bf16(f32), err_msg=name)
        assert np.all(bits[:, V:] == 0)
    np.testing.assert_array_equal(got["flat"][0], got["rows"][0])
    # the layer (the flat kernel in the simulator), and the reference: (p - onehot) * dloss, one rounding each
    # in float32 against one in float64 (then to float32) in the kernel, then bf16: within one bf16 step
    x = kdev.asarray(logits)
    classifier_backward(kdev, x, kdev.asarray(probs), t, dloss, V)
    np.testing.assert_array_equal(kdev.to_host(x), got["flat"][0])
    ref = logits.copy()
    classifier_backward_ref(ref, probs, targets, dloss, V)
    assert_within_one_step(got["flat"][0], ref)


# ---- on the GPU at GPT-2 size: each bf16 kernel against the float32 kernel on the same (widened) inputs ----
# |bf16 - f32| <= 2^-8 |f32| per element (assert_rounded_float32 prints the worst error and the share of
# elements bit-identical to round_to_nearest(float32 kernel): the compiled uint16 kernels do the float32
# kernels' float arithmetic op for op, so all of them should be). Statistics and losses stay float32: the
# float32 kernel's values, checked to 1e-6 per element and printed.
SIZES = {"N": 16384, "C": 768, "rows": 4096, "V": 50257, "Vp": 50304}


def assert_float32_close(name, got, want, rel=1e-6):
    err = np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    print(f"{name}: worst relative error per element {err.max():.3e}; {np.mean(got == want):.4%} bit-identical")
    assert err.max() <= rel


# d12's rows and channels (the register kernels), and d48's channels (the loop kernels, C > 1024)
@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(SIZES["N"], SIZES["C"]), (4096, 1600)])
def test_layernorm_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng, N, C):
    inp, weight, bias = ln_inputs(rng, (N, C))
    (out, mean, rstd), (out32, mean32, rstd32) = ln_forward_both(kdev, inp, weight, bias,
                                                                 lambda *a: layernorm_forward(kdev, *a))
    assert_rounded_float32("layernorm forward out", out, out32)
    assert_float32_close("layernorm forward mean", mean, mean32)
    assert_float32_close("layernorm forward rstd", rstd, rstd32)
    # backward from the float32 kernel's statistics, into random bf16 gradients (small: as in training)
    dout, dinp0, dw0, db0 = ln_grads(rng, (N, C))
    starts = [dinp0, f32_to_bf16(widen(dw0) * 1e-2), f32_to_bf16(widen(db0) * 1e-2)]
    got, want32 = ln_backward_both(kdev, (N, C), dout, inp, weight, starts, mean32, rstd32,
                                   lambda *a: layernorm_backward(kdev, *a))
    for name, g, w in zip(("dinp", "dweight", "dbias"), got, want32):
        assert_rounded_float32(f"layernorm backward {name}", g, w)


@pytest.mark.gpu
def test_classifier_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    rows, V, Vp = SIZES["rows"], SIZES["V"], SIZES["Vp"]
    logits, targets = cls_inputs(rng, rows, V, Vp)
    (losses, probs), (losses32, probs32) = cls_forward_both(kdev, logits, targets,
                                                            lambda *a: classifier_forward(kdev, *a, V))
    assert_rounded_float32("classifier forward probs", probs, probs32)
    assert_float32_close("classifier forward losses", losses, losses32)
    assert np.all(probs[:, V:] == 0)
    # backward from the bf16 probs, overwriting the logits in place
    t, dloss = kdev.asarray(targets), 1.0 / rows
    x, x32 = kdev.asarray(logits), kdev.asarray(widen(logits))
    classifier_backward(kdev, x, kdev.asarray(probs), t, dloss, V)
    classifier_backward(kdev, x32, kdev.asarray(widen(probs)), t, dloss, V)
    assert_rounded_float32("classifier backward dlogits (in place)", kdev.to_host(x), kdev.to_host(x32))

