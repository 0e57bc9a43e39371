"""Classifier (softmax + cross-entropy over the first V of Vp logits): the kernels against the NumPy
reference, padded columns that never matter, the reference backward against finite differences."""
import numpy as np
import pytest

from helpers import finite_diff, poisoned, rel_err
from llmz.kernels.classifier import (
    classifier_backward,
    classifier_backward_ref,
    classifier_forward,
    classifier_forward_ref,
)

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
