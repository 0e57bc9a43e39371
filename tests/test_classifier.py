"""Classifier (llmz/kernels/classifier.py, the teaching kernels: softmax + cross-entropy over the first V of Vp
logits): against the NumPy reference, padded columns that never matter, the references against finite
differences, the model's two calls (classifier_loss, classifier_fused), bf16 storage. The fused fast kernels:
tests/test_fast_classifier.py."""
import numpy as np
import pytest

from helpers import (
    NAN_BF16,
    assert_rounded_float32,
    assert_within_one_step,
    finite_diff,
    gpu_ms_per_call,
    poisoned,
    poisoned_bf16,
    rel_err,
)
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.classifier import (
    classifier_backward,
    classifier_backward_kernel,
    classifier_backward_ref,
    classifier_forward,
    classifier_forward_ref,
    classifier_fused,
    classifier_fused_ref,
    classifier_loss,
)
from llmz.kernels.grid import ceil_div

B, T, V, Vp = 2, 3, 50, 64          # 64 columns: two sim blocks' worth of threads, V not a multiple of 32


def random_inputs(rng, B=B, T=T, V=V, Vp=Vp):
    logits = rng.normal(size=(B, T, Vp)) * 3                  # padded columns random too: must not matter
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    return logits, targets


def forward_ref64(logits, targets, V):
    probs = np.empty(logits.shape)
    losses = np.empty(logits.shape[:2])
    classifier_forward_ref(losses, probs, logits.astype(np.float64), targets, V)
    return losses, probs


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6),     # float32 exp/log: a few ulps per element
                                        (np.float64, 1e-13)])
def test_classifier_forward_kernel_matches_reference(kdev, rng, dtype, tol):
    logits, targets = random_inputs(rng)
    losses = poisoned(kdev, (B, T), dtype)
    probs = poisoned(kdev, (B, T, Vp), dtype)
    classifier_forward(kdev, losses, probs, kdev.asarray(logits, dtype), kdev.asarray(targets), V)
    ref_losses, ref_probs = forward_ref64(logits.astype(dtype), targets, V)
    p = kdev.to_host(probs)
    assert rel_err(p, ref_probs) < tol
    assert rel_err(kdev.to_host(losses), ref_losses) < tol
    assert np.all(p[..., V:] == 0)


def test_classifier_forward_reference_float32_matches_float64(rng):
    logits, targets = random_inputs(rng)
    losses = np.empty((B, T), np.float32)
    probs = np.empty((B, T, Vp), np.float32)
    classifier_forward_ref(losses, probs, logits.astype(np.float32), targets, V)
    ref_losses, ref_probs = forward_ref64(logits.astype(np.float32), targets, V)
    assert probs.dtype == np.float32 and losses.dtype == np.float32
    # float32 exp and sums of 50 terms: well under 1e-6
    assert rel_err(probs, ref_probs) < 1e-6 and rel_err(losses, ref_losses) < 1e-6
    assert np.allclose(probs[..., :V].sum(-1), 1, atol=1e-6)


@pytest.mark.parametrize("pad", [1e30, -1e30])
def test_classifier_padded_columns_change_nothing(kdev, rng, pad):
    logits, targets = random_inputs(rng)
    huge = logits.copy()
    huge[..., V:] = pad                                       # would overflow exp or win the max if used
    outs = []
    for x in (logits, huge):
        losses, probs = poisoned(kdev, (B, T)), poisoned(kdev, (B, T, Vp))
        classifier_forward(kdev, losses, probs, kdev.asarray(x, np.float32), kdev.asarray(targets), V)
        ref_losses, ref_probs = forward_ref64(x, targets, V)
        outs.append((kdev.to_host(losses), kdev.to_host(probs), ref_losses, ref_probs))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)                           # bit-identical, kernel and reference


def test_classifier_backward_kernel_matches_reference(kdev, rng):
    logits, targets = random_inputs(rng)
    _, probs = forward_ref64(logits, targets, V)
    probs[..., V:] = rng.random(size=(B, T, Vp - V))          # padded columns must not leak into dlogits
    dloss = 1.0 / (B * T)
    dlogits = poisoned(kdev, (B, T, Vp))                      # overwrites: every element must be written
    classifier_backward(kdev, dlogits, kdev.asarray(probs, np.float32), kdev.asarray(targets), dloss, V)
    ref = np.empty_like(probs)
    classifier_backward_ref(ref, probs, targets, dloss, V)
    d = kdev.to_host(dlogits)
    # float32 probs: one rounding of p, one of (p - 1) * dloss
    assert rel_err(d, ref) < 1e-6
    assert np.all(d[..., V:] == 0)


def test_classifier_backward_kernel_overwrites_logits_in_place(kdev, rng):
    logits, targets = random_inputs(rng)
    dloss = 1.0 / (B * T)
    x = kdev.asarray(logits, np.float32)
    losses, probs = poisoned(kdev, (B, T)), poisoned(kdev, (B, T, Vp))
    classifier_forward(kdev, losses, probs, x, kdev.asarray(targets), V)
    classifier_backward(kdev, x, probs, kdev.asarray(targets), dloss, V)   # dlogits IS the logits buffer
    _, ref_probs = forward_ref64(logits.astype(np.float32), targets, V)
    ref = np.empty_like(ref_probs)
    classifier_backward_ref(ref, ref_probs, targets, dloss, V)
    assert rel_err(kdev.to_host(x), ref) < 1e-6              # float32 probs, as above


def test_classifier_reference_backward_matches_finite_differences(rng):
    logits, targets = random_inputs(rng)
    dloss = 1.0 / (B * T)                                     # d(mean loss) / d(loss[b,t])

    def losses_of(x):
        return forward_ref64(x, targets, V)[0]
    _, probs = forward_ref64(logits, targets, V)
    dlogits = np.full(logits.shape, np.nan)
    classifier_backward_ref(dlogits, probs, targets, dloss, V)
    # all Vp columns: the padded ones must have derivative 0 and get 0
    idx, g = finite_diff(losses_of, logits, np.full((B, T), dloss))
    assert rel_err(dlogits.reshape(-1)[idx], g) < 1e-6
    assert np.all(dlogits[..., V:] == 0)


def fused_ref64(logits, targets, dloss, V):
    """The fused reference in float64: (losses, dlogits)."""
    d = logits.astype(np.float64)
    losses = np.empty(logits.shape[:-1])
    classifier_fused_ref(losses, d, targets, dloss, V)
    return losses, d


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_classifier_fused_reference_is_forward_reference_then_backward_reference(rng, dtype):
    logits, targets = random_inputs(rng)
    logits = logits.astype(dtype)
    dloss = 1.0 / (3 * B * T)
    losses, probs, dlogits = np.empty((B, T), dtype), np.empty_like(logits), np.empty_like(logits)
    classifier_forward_ref(losses, probs, logits, targets, V)
    classifier_backward_ref(dlogits, probs, targets, dloss, V)
    fused_losses, x = np.empty((B, T), dtype), logits.copy()
    classifier_fused_ref(fused_losses, x, targets, dloss, V)
    # the same operations on the same values, only in place: the same bits
    np.testing.assert_array_equal(fused_losses, losses)
    np.testing.assert_array_equal(x, dlogits)


def test_classifier_fused_reference_matches_finite_differences(rng):
    logits, targets = random_inputs(rng)
    dloss = 1.0 / (B * T)
    _, d = fused_ref64(logits, targets, dloss, V)
    # all Vp columns: the padded ones have derivative 0
    idx, g = finite_diff(lambda x: fused_ref64(x, targets, dloss, V)[0], logits, np.full((B, T), dloss))
    assert rel_err(d.reshape(-1)[idx], g) < 1e-6


@pytest.mark.parametrize("dev_kind", ["kernels", "cpu"])
def test_classifier_fused_and_loss_layers_match_reference(kdev, rng, dev_kind):
    from llmz.device import Device
    dev = kdev if dev_kind == "kernels" else Device("cpu", np.float32)
    ops = dev.ops                       # the teaching kernels, or on cpu the references (llmz.reference)
    logits, targets = random_inputs(rng)
    logits = logits.astype(np.float32)
    dloss, t = 1.0 / (B * T), dev.asarray(targets)
    ref_losses, ref_d = fused_ref64(logits, targets, dloss, V)
    # the loss layer: losses only, the logits untouched (on cpu the reference writes probs into its workspace)
    x, losses = dev.asarray(logits), poisoned(dev, (B, T))
    ops.classifier_loss(dev, losses, x, t, V)
    np.testing.assert_array_equal(dev.to_host(x), logits)
    loss_only = dev.to_host(losses).copy()
    # the fused layer, in place; the same losses again
    ops.classifier_fused(dev, losses, x, t, dloss, V)
    np.testing.assert_array_equal(dev.to_host(losses), loss_only)
    # float32 exps (float64 in the teaching kernel) and one rounding of (p - onehot) * dloss
    assert rel_err(loss_only, ref_losses) < 1e-6
    assert rel_err(dev.to_host(x), ref_d) < 1e-6


@pytest.mark.gpu
def test_classifier_kernels_match_float64_reference_at_gpt2_size(kdev, rng):
    B, T, V, Vp = 4, 1024, 50257, 50304
    logits, targets = random_inputs(rng, B, T, V, Vp)
    ref_losses, ref_probs = forward_ref64(logits.astype(np.float32), targets, V)
    x = kdev.asarray(logits, np.float32)
    losses, probs = poisoned(kdev, (B, T)), poisoned(kdev, (B, T, Vp))
    classifier_forward(kdev, losses, probs, x, kdev.asarray(targets), V)
    e_loss = rel_err(kdev.to_host(losses), ref_losses)
    e_prob = rel_err(kdev.to_host(probs), ref_probs)
    dloss = 1.0 / (B * T)
    classifier_backward(kdev, x, probs, kdev.asarray(targets), dloss, V)     # in place over the logits
    ref = np.empty_like(ref_probs)
    classifier_backward_ref(ref, ref_probs, targets, dloss, V)
    e_grad = rel_err(kdev.to_host(x), ref)
    print(f"classifier B={B} T={T} Vp={Vp}: rel err losses {e_loss:.2e}, probs {e_prob:.2e}, "
          f"dlogits {e_grad:.2e}")
    # float32 storage of probs and dlogits: about one ulp each
    assert e_loss < 1e-6 and e_prob < 1e-6 and e_grad < 1e-6


# ---- bf16 storage ---------------------------------------------------------------------------------
def nan32(dev, shape):
    """A float32 output (mean, rstd, losses) filled with NaN."""
    return dev.full(shape, np.nan, np.float32)


def widen(bits):
    """Host uint16 bits -> float32 values (exact): the float32 kernel's inputs."""
    return bf16_to_f32(bits)


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


def test_classifier_backward_kernels_on_bf16_overwrite_logits_in_place_as_the_rounded_float32_kernels(kdev, rng):
    rows, V, Vp = 6, 50, 64
    logits, targets = cls_inputs(rng, rows, V, Vp)
    probs = np.full((rows, Vp), NAN_BF16, np.uint16)
    classifier_forward_ref(np.empty(rows, np.float32), probs, logits, targets, V)
    probs[:, V:] = f32_to_bf16(rng.random(size=(rows, Vp - V)))     # padded columns must not leak into dlogits
    t, dloss = kdev.asarray(targets), 1.0 / rows
    # dlogits IS the logits buffer (bf16), overwritten in place
    got = []
    for conv in (lambda a: a, widen):
        x, p = kdev.asarray(conv(logits)), kdev.asarray(conv(probs))
        kdev.launch(classifier_backward_kernel, ceil_div(rows * Vp, kdev.block_size), kdev.block_size,
                    x.reshape(-1), p.reshape(-1), t, dloss, V, Vp, rows * Vp)
        got.append(kdev.to_host(x))
    np.testing.assert_array_equal(got[0], f32_to_bf16(got[1]))
    assert np.all(got[0][:, V:] == 0)
    # the layer, and the reference: (p - onehot) * dloss, one rounding each in float32 against one in float64
    # (then to float32) in the kernel, then bf16: within one bf16 step
    x = kdev.asarray(logits)
    classifier_backward(kdev, x, kdev.asarray(probs), t, dloss, V)
    np.testing.assert_array_equal(kdev.to_host(x), got[0])
    ref = logits.copy()
    classifier_backward_ref(ref, probs, targets, dloss, V)
    assert_within_one_step(got[0], ref)


def assert_float32_close(name, got, want, rel=1e-6):
    err = np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    print(f"{name}: worst relative error per element {err.max():.3e}; {np.mean(got == want):.4%} bit-identical")
    assert err.max() <= rel


@pytest.mark.gpu
def test_classifier_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    rows, V, Vp = 4096, 50257, 50304
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


@pytest.mark.gpu
def test_classifier_model_calls_match_float64_reference_at_gpt2_size(kdev, rng):
    rows, V, Vp = 4096, 50257, 50304                           # d12's vocabulary, B*T = 4 x 1024 rows
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0].astype(np.float32), targets[0]
    t, dloss = kdev.asarray(targets), 1.0 / (3 * rows)
    ref_losses, ref_d = fused_ref64(logits, targets, dloss, V)
    x, losses, only = kdev.asarray(logits), poisoned(kdev, rows), poisoned(kdev, rows)
    classifier_loss(kdev, only, x, t, V)
    classifier_fused(kdev, losses, x, t, dloss, V)
    np.testing.assert_array_equal(kdev.to_host(only), kdev.to_host(losses))
    errs = {"losses": rel_err(kdev.to_host(losses), ref_losses), "dlogits": rel_err(kdev.to_host(x), ref_d)}
    out = poisoned(kdev, rows)
    ms_fused = gpu_ms_per_call(kdev, lambda: classifier_fused(kdev, out, x, t, dloss, V))
    print(f"classifier teaching (forward + backward kernels) rows={rows}: relative error {errs}; "
          f"{ms_fused:.4f} ms per classifier_fused call")
    assert max(errs.values()) < 1e-6
