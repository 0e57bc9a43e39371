"""Classifier (softmax + cross-entropy over the first V of Vp logits): the kernels against the NumPy
reference, padded columns that never matter, the reference backward against finite differences. The fast
kernels (GPU only in the layer) need nothing the simulator lacks: they run here too, launched directly.
The fused kernel (loss and dlogits in one, in place over the logits: what the model's backward runs) and the
loss kernel (what its forward runs): against the fused reference, against the unfused kernels (the same loss
bits, dlogits within an ulp), and on bf16 storage (the float32 kernel's results, rounded)."""
import types

import numpy as np
import pytest
from test_bf16_storage import NAN_BF16, assert_rounded_float32, assert_within_one_step

from helpers import finite_diff, gpu_ms_per_call, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.device import ceil_div
from llmz.kernels.bf16 import pair_view
from llmz.kernels.classifier import (
    classifier_backward,
    classifier_backward_kernel,
    classifier_backward_ref,
    classifier_backward_rows_kernel,
    classifier_forward,
    classifier_forward_online_kernel,
    classifier_forward_ref,
    classifier_fused,
    classifier_fused_kernel,
    classifier_fused_pairs_kernel,
    classifier_fused_ref,
    classifier_loss,
    classifier_loss_kernel,
    classifier_loss_pairs_kernel,
    row_block,
    row_pairs_apply,
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


# ---- the fast kernels ---------------------------------------------------------------------------
def online_forward(dev, losses, probs, logits, targets, V):
    """classifier_forward_online_kernel on (rows, Vp) arrays, one block per row, as the layer launches it."""
    dev.launch(classifier_forward_online_kernel, logits.shape[0], dev.block_size, losses, probs, logits,
               targets, V)


def rows_backward(dev, dlogits, probs, targets, dloss, V):
    """classifier_backward_rows_kernel on (rows, Vp) arrays, grid (rows, column blocks), as the layer does."""
    rows, Vp = probs.shape
    dev.launch(classifier_backward_rows_kernel, (rows, ceil_div(Vp, dev.block_size)), dev.block_size,
               dlogits, probs, targets, float(dloss), V)


# (7,100,131): Vp not a multiple of the block, several columns per thread; (3,20,24): fewer columns than
# threads (idle threads keep their starting max, column 0's logit, and a zero sum); "rising": every column
# a new running max, so every step rescales the running sum
@pytest.mark.parametrize("rows, V, Vp, order", [(7, 100, 131, "random"), (3, 20, 24, "random"),
                                                (7, 100, 131, "rising")])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6),     # float32 exps: a few ulps per element
                                        (np.float64, 1e-13)])
def test_classifier_forward_online_kernel_matches_reference(kdev, rng, rows, V, Vp, order, dtype, tol):
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0], targets[0]
    if order == "rising":
        logits[:, :V] = np.sort(logits[:, :V], axis=1)
    losses, probs = poisoned(kdev, rows, dtype), poisoned(kdev, (rows, Vp), dtype)
    online_forward(kdev, losses, probs, kdev.asarray(logits, dtype), kdev.asarray(targets), V)
    ref_losses, ref_probs = np.empty(rows), np.empty((rows, Vp))
    classifier_forward_ref(ref_losses, ref_probs, logits.astype(dtype).astype(np.float64), targets, V)
    p = kdev.to_host(probs)
    assert rel_err(p, ref_probs) < tol
    assert rel_err(kdev.to_host(losses), ref_losses) < tol
    assert np.all(p[:, V:] == 0)


def test_classifier_backward_rows_kernel_gives_the_teaching_kernels_bits(kdev, rng):
    rows, V, Vp = 7, 100, 131
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    probs = np.empty((rows, Vp))
    classifier_forward_ref(np.empty(rows), probs, logits[0], targets[0], V)
    probs[:, V:] = rng.random(size=(rows, Vp - V))            # padded columns must not leak into dlogits
    p, t = kdev.asarray(probs, np.float32), kdev.asarray(targets[0])
    dloss = 1.0 / rows
    fast, slow = poisoned(kdev, (rows, Vp)), poisoned(kdev, (rows, Vp))   # overwrites: all must be written
    rows_backward(kdev, fast, p, t, dloss, V)
    kdev.launch(classifier_backward_kernel, ceil_div(rows * Vp, kdev.block_size), kdev.block_size,
                slow.reshape(-1), p.reshape(-1), t, dloss, V, Vp, rows * Vp)
    # the same arithmetic per element, only the index math differs
    np.testing.assert_array_equal(kdev.to_host(fast), kdev.to_host(slow))
    ref = np.empty_like(probs)
    classifier_backward_ref(ref, kdev.to_host(p).astype(np.float64), targets[0], dloss, V)
    # float32 probs: one rounding of (p - onehot) * dloss
    assert rel_err(kdev.to_host(fast), ref) < 1e-6


# (4096, 50257, 50304): d12's vocabulary, B*T = 4 x 1024 rows; (7, 100, 131): few rows, Vp % 256 != 0
@pytest.mark.gpu
@pytest.mark.parametrize("rows, V, Vp", [(4096, 50257, 50304), (7, 100, 131)])
def test_classifier_fast_kernels_match_float64_reference_and_repeat_bits_on_gpu(kdev, rng, rows, V, Vp):
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0].astype(np.float32), targets[0]
    x, t = kdev.asarray(logits), kdev.asarray(targets)
    # forward through the layer (the online kernel on a GPU), twice into NaN-poisoned outputs
    runs = []
    for _ in range(2):
        losses, probs = poisoned(kdev, rows), poisoned(kdev, (rows, Vp))
        classifier_forward(kdev, losses, probs, x, t, V)
        runs.append((kdev.to_host(losses), kdev.to_host(probs)))
    ref_losses, ref_probs = np.empty(rows), np.empty((rows, Vp))
    classifier_forward_ref(ref_losses, ref_probs, logits.astype(np.float64), targets, V)
    errs = {"losses": rel_err(runs[0][0], ref_losses), "probs": rel_err(runs[0][1], ref_probs)}
    assert np.all(runs[0][1][:, V:] == 0)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    # backward through the layer (the rows kernel), twice into NaN-poisoned dlogits (it overwrites: there is
    # no accumulating output here), from the kernel's own probs
    dloss = 1.0 / rows
    grads = []
    for _ in range(2):
        dlogits = poisoned(kdev, (rows, Vp))
        classifier_backward(kdev, dlogits, probs, t, dloss, V)
        grads.append(kdev.to_host(dlogits))
    want = np.empty((rows, Vp))
    classifier_backward_ref(want, runs[0][1].astype(np.float64), targets, dloss, V)
    errs["dlogits"] = rel_err(grads[0], want)
    np.testing.assert_array_equal(grads[0], grads[1])
    # time each kernel alone (the layer launches exactly one)
    ms_f = gpu_ms_per_call(kdev, lambda: classifier_forward(kdev, losses, probs, x, t, V))
    ms_b = gpu_ms_per_call(kdev, lambda: classifier_backward(kdev, dlogits, probs, t, dloss, V))
    nbytes = rows * Vp * 4
    print(f"classifier fast kernels rows={rows} V={V} Vp={Vp}: worst relative error {max(errs.values()):.2e} "
          f"{errs}; forward {ms_f:.4f} ms ({3 * nbytes / ms_f / 1e6:.0f} GB/s: 2 reads + 1 write), "
          f"backward {ms_b:.4f} ms ({2 * nbytes / ms_b / 1e6:.0f} GB/s) per call")
    # probs: float32 exps (<= 2 ulps) of float32 differences x - m (exact near the row max, where the
    # probabilities that carry the norm are), sums and scale in float64; a NumPy emulation of this arithmetic
    # at this size gave 3e-8. losses: float64 log and sums. dlogits: one rounding of (p - onehot) * dloss.
    assert max(errs.values()) < 1e-6


# ---- the fused kernel: loss and dlogits in one, in place over the logits --------------------------------
def fused_ref64(logits, targets, dloss, V):
    """The fused reference in float64: (losses, dlogits)."""
    d = logits.astype(np.float64)
    losses = np.empty(logits.shape[:-1])
    classifier_fused_ref(losses, d, targets, dloss, V)
    return losses, d


def fused_inputs(rng, rows, V, Vp, order="random"):
    """(rows, Vp) logits whose padded columns are NaN: each must be overwritten (with 0) and none may reach a
    real column (a real column left unwritten keeps its logit, far from its dlogit); int32 targets."""
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0], targets[0]
    if order == "rising":
        logits[:, :V] = np.sort(logits[:, :V], axis=1)
    logits[:, V:] = np.nan
    return logits, targets


def launch_fused(dev, losses, logits, targets, dloss, V, block):
    dev.launch(classifier_fused_kernel, logits.shape[0], block, losses, logits, targets, float(dloss), V)


# (5,37,40): V=37 padded to 40, fewer columns than threads; (4,300,320): groups of four columns and a tail;
# block 8 and 5 (not a power of two): groups and tails on a short row; "rising": every group a new max.
# float32: float32 exps, a few ulps per element; float64: float64 throughout
TOL = {"float32": 1e-6, "float64": 1e-13}
FUSED_CASES = [(5, 37, 40, 32, "random", "float32"), (5, 37, 40, 32, "random", "float64"),
               (4, 300, 320, 32, "random", "float32"), (4, 300, 320, 32, "rising", "float64"),
               (4, 37, 40, 8, "rising", "float32"), (3, 37, 40, 5, "random", "float32")]


@pytest.mark.parametrize("rows, V, Vp, block, order, dtype", FUSED_CASES)
def test_classifier_fused_kernel_matches_reference(kdev, rng, rows, V, Vp, block, order, dtype):
    tol = TOL[dtype]
    logits, targets = fused_inputs(rng, rows, V, Vp, order)
    dloss = 1.0 / (3 * rows)                                  # not a power of two (K = 3 micro-steps)
    losses, x = poisoned(kdev, rows, dtype), kdev.asarray(logits, dtype)
    launch_fused(kdev, losses, x, kdev.asarray(targets), dloss, V, block)
    ref_losses, ref_d = fused_ref64(logits.astype(dtype), targets, dloss, V)
    d = kdev.to_host(x)
    assert np.all(d[:, V:] == 0)                              # padded columns: written, no gradient
    assert rel_err(d, ref_d) < tol
    assert rel_err(kdev.to_host(losses), ref_losses) < tol
    # the loss kernel: the fused kernel's loss bits, and it writes nothing else
    x = kdev.asarray(logits, dtype)
    only = poisoned(kdev, rows, dtype)
    kdev.launch(classifier_loss_kernel, rows, block, only, x, kdev.asarray(targets), V)
    np.testing.assert_array_equal(kdev.to_host(only), kdev.to_host(losses))
    np.testing.assert_array_equal(kdev.to_host(x), logits.astype(dtype))


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


def test_classifier_fused_kernel_gives_unfused_losses_bit_for_bit_and_dlogits_within_one_ulp(kdev, rng):
    rows, V, Vp = 3, 300, 320
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0].astype(np.float32), kdev.asarray(targets[0])
    dloss = 1.0 / (3 * rows)
    # unfused: the online forward (probs), then the rows backward over the logits
    x, losses, probs = kdev.asarray(logits), poisoned(kdev, rows), poisoned(kdev, (rows, Vp))
    online_forward(kdev, losses, probs, x, targets, V)
    rows_backward(kdev, x, probs, targets, dloss, V)
    # fused, at the same block size
    y, fused_losses = kdev.asarray(logits), poisoned(kdev, rows)
    launch_fused(kdev, fused_losses, y, targets, dloss, V, kdev.block_size)
    # the same row statistics and loss arithmetic
    np.testing.assert_array_equal(kdev.to_host(fused_losses), kdev.to_host(losses))
    # the unfused path rounds p to float32 before (p - onehot) * dloss, the fused one does not
    want, got = kdev.to_host(x), kdev.to_host(y)
    assert np.all(np.abs(got - want) <= np.spacing(np.abs(want)))


@pytest.mark.parametrize("dev_kind", ["kernels", "cpu"])
def test_classifier_fused_and_loss_layers_match_reference(kdev, rng, dev_kind):
    from llmz.device import Device
    dev = kdev if dev_kind == "kernels" else Device("cpu", np.float32)
    logits, targets = random_inputs(rng)
    logits = logits.astype(np.float32)
    dloss, t = 1.0 / (B * T), dev.asarray(targets)
    ref_losses, ref_d = fused_ref64(logits, targets, dloss, V)
    # the loss layer: losses only, the logits untouched (on cpu the reference writes probs into its workspace)
    x, losses = dev.asarray(logits), poisoned(dev, (B, T))
    classifier_loss(dev, losses, x, t, V)
    np.testing.assert_array_equal(dev.to_host(x), logits)
    loss_only = dev.to_host(losses).copy()
    # the fused layer, in place; the same losses again
    classifier_fused(dev, losses, x, t, dloss, V)
    np.testing.assert_array_equal(dev.to_host(losses), loss_only)
    # float32 exps and one rounding of (p - onehot) * dloss
    assert rel_err(loss_only, ref_losses) < 1e-6
    assert rel_err(dev.to_host(x), ref_d) < 1e-6


# ---- the fused and loss kernels on bf16 storage (uint16 bits) -------------------------------------------
@pytest.mark.parametrize("rows, V, Vp, block", [(4, 300, 320, 32), (3, 37, 40, 8)])
def test_classifier_fused_kernel_on_bf16_is_the_rounded_float32_kernel(kdev, rng, rows, V, Vp, block):
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    bits, targets = f32_to_bf16(logits[0]), targets[0]
    bits[:, V:] = NAN_BF16                                    # the poison, as above
    t, dloss = kdev.asarray(targets), 1.0 / (3 * rows)
    out = {}
    for name, host in (("bf16", bits), ("f32", bf16_to_f32(bits))):
        x, losses = kdev.asarray(host), kdev.full(rows, np.nan, np.float32)   # losses float32 beside bf16
        launch_fused(kdev, losses, x, t, dloss, V, block)
        only = kdev.full(rows, np.nan, np.float32)
        kdev.launch(classifier_loss_kernel, rows, block, only, kdev.asarray(host), t, V)
        out[name] = (kdev.to_host(losses), kdev.to_host(x), kdev.to_host(only))
    (losses, d, only), (losses32, d32, only32) = out["bf16"], out["f32"]
    # the uint16 specialisation does the float32 arithmetic and rounds at the store
    np.testing.assert_array_equal(d, f32_to_bf16(d32))
    np.testing.assert_array_equal(losses, losses32)
    np.testing.assert_array_equal(only, losses)
    np.testing.assert_array_equal(only32, losses32)
    assert np.all(d[:, V:] == 0)
    # the reference's bf16 path: float32 exps and sums (the kernel: float64 sums), dlogits rounded once
    ref_losses, ref_d = np.empty(rows, np.float32), bits.copy()
    classifier_fused_ref(ref_losses, ref_d, targets, dloss, V)
    assert_within_one_step(d, ref_d)
    assert rel_err(losses, ref_losses) < 1e-6


# ---- on the GPU at GPT-2 size -------------------------------------------------------------------------
@pytest.mark.gpu
def test_classifier_fused_kernel_matches_float64_reference_and_unfused_kernels_at_gpt2_size(kdev, rng):
    rows, V, Vp = 4096, 50257, 50304                           # d12's vocabulary, B*T = 4 x 1024 rows
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0].astype(np.float32), targets[0]
    t, dloss = kdev.asarray(targets), 1.0 / (3 * rows)
    ref_losses, ref_d = fused_ref64(logits, targets, dloss, V)
    # the fused layer twice, in place, losses NaN-poisoned: the same bits both times
    runs = []
    for _ in range(2):
        x, losses = kdev.asarray(logits), poisoned(kdev, rows)
        classifier_fused(kdev, losses, x, t, dloss, V)
        runs.append((kdev.to_host(losses), kdev.to_host(x)))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    losses, d = runs[0]
    assert np.all(d[:, V:] == 0)
    errs = {"losses": rel_err(losses, ref_losses), "dlogits": rel_err(d, ref_d)}
    worst = np.abs(d - ref_d) / np.maximum(np.abs(ref_d), np.finfo(np.float32).tiny)
    # the loss layer: the same loss bits
    only = poisoned(kdev, rows)
    classifier_loss(kdev, only, kdev.asarray(logits), t, V)
    np.testing.assert_array_equal(kdev.to_host(only), losses)
    # the unfused fast kernels (online forward, at the fused kernel's block size as the layer launches it,
    # then the rows backward): the same loss bits, dlogits within 2 ulps
    x, un_losses, probs = kdev.asarray(logits), poisoned(kdev, rows), poisoned(kdev, (rows, Vp))
    kdev.launch(classifier_forward_online_kernel, rows, row_block(kdev), un_losses, probs, x, t, V)
    rows_backward(kdev, x, probs, t, dloss, V)
    un_d = kdev.to_host(x)
    np.testing.assert_array_equal(kdev.to_host(un_losses), losses)
    ulps = np.abs(d - un_d) / np.spacing(np.abs(un_d))
    # time: the fused kernel against the pair it replaces, and the loss kernel (x keeps being overwritten
    # in place: the values change, the work does not)
    out = poisoned(kdev, rows)
    ms_fused = gpu_ms_per_call(kdev, lambda: classifier_fused(kdev, out, x, t, dloss, V))
    ms_loss = gpu_ms_per_call(kdev, lambda: classifier_loss(kdev, out, x, t, V))
    ms_pair = gpu_ms_per_call(kdev, lambda: (classifier_forward(kdev, out, probs, x, t, V),
                                             classifier_backward(kdev, x, probs, t, dloss, V)))
    nbytes = rows * Vp * 4
    print(f"classifier fused rows={rows} V={V} Vp={Vp}: relative error {errs}, worst per element "
          f"{worst.max():.2e}; vs unfused: losses bit-identical, dlogits worst {ulps.max():.1f} ulp "
          f"({np.mean(ulps == 0):.4%} identical); fused {ms_fused:.4f} ms ({3 * nbytes / ms_fused / 1e6:.0f} GB/s "
          f"as 2 reads + 1 write), loss {ms_loss:.4f} ms ({nbytes / ms_loss / 1e6:.0f} GB/s), unfused pair "
          f"{ms_pair:.4f} ms per call")
    # float32 exps (<= 2 ulps) of exact x - m near the row max, float64 sums, one rounding of the dlogit
    assert max(errs.values()) < 1e-6
    assert ulps.max() <= 2


@pytest.mark.gpu
def test_classifier_fused_kernel_on_bf16_is_the_rounded_float32_kernel_at_gpt2_size(kdev, rng):
    rows, V, Vp = 4096, 50257, 50304
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    bits, t, dloss = f32_to_bf16(logits[0]), kdev.asarray(targets[0]), 1.0 / (3 * rows)
    out = {}
    for name, host in (("bf16", bits), ("f32", bf16_to_f32(bits))):
        x, losses = kdev.asarray(host), kdev.full(rows, np.nan, np.float32)
        classifier_fused(kdev, losses, x, t, dloss, V)
        out[name] = (kdev.to_host(losses), kdev.to_host(x))
    (losses, d), (losses32, d32) = out["bf16"], out["f32"]
    x, scratch = kdev.asarray(bits), kdev.full(rows, np.nan, np.float32)
    ms = gpu_ms_per_call(kdev, lambda: classifier_fused(kdev, scratch, x, t, dloss, V))
    ms_loss = gpu_ms_per_call(kdev, lambda: classifier_loss(kdev, scratch, x, t, V))
    assert_rounded_float32("classifier fused dlogits (bf16, in place)", d, d32)
    np.testing.assert_array_equal(losses, losses32)
    assert np.all(d[:, V:] == 0)
    nbytes = rows * Vp * 2
    print(f"classifier fused bf16: {ms:.4f} ms ({3 * nbytes / ms / 1e6:.0f} GB/s as 2 reads + 1 write), "
          f"loss only {ms_loss:.4f} ms ({nbytes / ms_loss / 1e6:.0f} GB/s) per call")


# ---- the paired fused and loss kernels (GPU path for float32 and bf16): the scalar kernels' bits ------------
# Launched directly here (the layers take them only on a GPU), on pair_view words, with nb threads per row:
# they stand for the scalar kernels at 2 nb threads. (37, 40, 4): a step of four words and a tail where a
# word's low half is < V and its high half not; (29, 32, 4): V odd, thread 2's low halves take a last step of
# four ending on column V-1 while its high halves go one at a time; (64, 72, 3): V even, two steps, a block
# that is not a power of two (the reduction trees' ragged levels), "rising": every step a new max. Padded
# columns are NaN (they must be written with 0 and never read into a real column); the targets of the two
# rows are the first and the last real column.
PAIR_CASES = [(37, 40, 4, "random"), (29, 32, 4, "random"), (64, 72, 3, "rising")]


def storage_logits(logits, V, storage):
    """float32 logits, or their bf16 bits (uint16); the padded columns NaN (the bf16 quiet NaN)."""
    x = logits.astype(np.float32) if storage == "float32" else f32_to_bf16(logits)
    x[:, V:] = np.nan if storage == "float32" else NAN_BF16
    return x


def edge_targets(rng, rows, V):
    """int32 targets: row 0 column 0, row 1 column V - 1, the others (rows > 2) random."""
    t = rng.integers(0, V, size=rows).astype(np.int32)
    t[:2] = 0, V - 1
    return t


def bits(a) -> np.ndarray:
    """Stored bits to compare (float32 as uint32; bf16 already bits), NaN included."""
    return a.view(np.uint32) if a.dtype == np.float32 else a


def fused_scalar_and_pairs(dev, logits, targets, dloss, V, nb):
    """(losses, dlogits) of the scalar fused kernel at block 2 nb and of the paired one at nb, and the losses of
    the two loss kernels; every output starts NaN, the logits (rows, Vp) from copies of `logits`."""
    rows = logits.shape[0]
    t = dev.asarray(targets)
    out = []
    for fused, loss, block, view in ((classifier_fused_kernel, classifier_loss_kernel, 2 * nb, lambda a: a),
                                     (classifier_fused_pairs_kernel, classifier_loss_pairs_kernel, nb, pair_view)):
        x, losses, only = dev.asarray(logits), dev.full(rows, np.nan, np.float32), dev.full(rows, np.nan, np.float32)
        dev.launch(fused, rows, block, losses, view(x), t, float(dloss), V)
        dev.launch(loss, rows, block, only, view(dev.asarray(logits)), t, V)
        out.append((dev.to_host(losses), dev.to_host(x), dev.to_host(only)))
    return out


@pytest.mark.parametrize("storage", ["float32", "bf16"])
@pytest.mark.parametrize("V, Vp, nb, order", PAIR_CASES)
def test_classifier_pairs_kernels_are_the_scalar_kernels_at_twice_the_block_bit_for_bit(kdev, rng, storage, V,
                                                                                         Vp, nb, order):
    rows = 2
    logits, _ = fused_inputs(rng, rows, V, Vp, order)
    x = storage_logits(logits, V, storage)
    targets, dloss = edge_targets(rng, rows, V), 1.0 / (3 * rows)
    (losses, d, only), (losses_p, d_p, only_p) = fused_scalar_and_pairs(kdev, x, targets, dloss, V, nb)
    # the same columns per (stood-for) thread, steps, exponentials, sums and trees: the same bits
    np.testing.assert_array_equal(bits(d_p), bits(d))
    np.testing.assert_array_equal(bits(losses_p), bits(losses))
    np.testing.assert_array_equal(bits(only_p), bits(only))
    np.testing.assert_array_equal(bits(only), bits(losses))
    # every element written (no NaN left), padded columns +0 exactly, the targets' dlogits negative
    assert not np.isnan(losses_p).any()
    assert np.all(bits(d_p)[:, V:] == 0)
    dv = d_p.astype(np.float64) if storage == "float32" else bf16_to_f32(d_p).astype(np.float64)
    assert not np.isnan(dv).any()
    assert np.all(dv[np.arange(rows), targets] < 0)
    # and both against the float64 reference (of the stored logits): float32 exps, one rounding per dlogit
    ref_losses, ref_d = fused_ref64(x.astype(np.float64) if storage == "float32" else
                                    bf16_to_f32(x).astype(np.float64), targets, dloss, V)
    assert rel_err(losses_p, ref_losses) < 1e-6
    assert rel_err(dv, ref_d) < (1e-6 if storage == "float32" else 4e-3)    # bf16: half a step, 2^-9


def test_classifier_pairs_apply_only_to_even_rows_of_float32_or_bf16_on_a_gpu():
    gpu, sim = types.SimpleNamespace(kind="gpu"), types.SimpleNamespace(kind="sim")
    f32, b16 = np.zeros((3, 40), np.float32), np.zeros((3, 40), np.uint16)
    assert row_pairs_apply(gpu, f32) and row_pairs_apply(gpu, b16)
    assert not row_pairs_apply(sim, f32)                                 # the simulator's layers: scalar
    assert not row_pairs_apply(gpu, np.zeros((2, 41), np.float32))       # an even size, odd rows
    assert not row_pairs_apply(gpu, np.zeros((3, 40)))                   # float64
    assert not row_pairs_apply(gpu, np.zeros(81, np.float32)[1:].reshape(2, 40))    # starts at an odd element


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["float32", "bf16"])
def test_classifier_pairs_layers_are_the_scalar_kernels_bit_for_bit_at_d12_size(kdev, rng, storage):
    rows, V, Vp = 4096, 50257, 50304                           # d12's vocabulary, B*T = 4 x 1024 rows
    logits, _ = fused_inputs(rng, rows, V, Vp)
    targets, dloss = edge_targets(rng, rows, V), 1.0 / (3 * rows)
    t, block = kdev.asarray(targets), row_block(kdev)
    host = storage_logits(logits, V, storage)
    # the layers (the paired kernels on a GPU, at half row_block's threads), then the scalar kernel at row_block,
    # each from NaN-poisoned losses
    x, losses, only = kdev.asarray(host), kdev.full(rows, np.nan, np.float32), kdev.full(rows, np.nan, np.float32)
    assert row_pairs_apply(kdev, x)
    classifier_fused(kdev, losses, x, t, dloss, V)
    classifier_loss(kdev, only, kdev.asarray(host), t, V)
    y, losses_s = kdev.asarray(host), kdev.full(rows, np.nan, np.float32)
    kdev.launch(classifier_fused_kernel, rows, block, losses_s, y, t, float(dloss), V)
    d, d_s = kdev.to_host(x), kdev.to_host(y)
    lo, lo_s, lo_only = kdev.to_host(losses), kdev.to_host(losses_s), kdev.to_host(only)
    f = (lambda a: a.astype(np.float64)) if storage == "float32" else (lambda a: bf16_to_f32(a).astype(np.float64))
    worst_d = np.nanmax(np.abs(f(d) - f(d_s)))
    worst_l = np.nanmax(np.abs(lo.astype(np.float64) - lo_s))
    same = np.mean(bits(d) == bits(d_s))
    # time: the paired layers and the scalar kernel (x keeps being overwritten in place: the values change, the
    # work does not)
    ms_p = gpu_ms_per_call(kdev, lambda: classifier_fused(kdev, losses, x, t, dloss, V))
    ms_s = gpu_ms_per_call(kdev, lambda: kdev.launch(classifier_fused_kernel, rows, block, losses_s, y, t,
                                                      float(dloss), V))
    ms_loss = gpu_ms_per_call(kdev, lambda: classifier_loss(kdev, only, x, t, V))
    nbytes = rows * Vp * host.itemsize
    print(f"classifier pairs vs scalar, {storage}, rows={rows} V={V} Vp={Vp}, block {block // 2} vs {block}: "
          f"dlogits {same:.6%} bit-identical (worst |diff| {worst_d:.3e}), losses worst |diff| {worst_l:.3e}, "
          f"loss layer = fused losses: {np.array_equal(bits(lo_only), bits(lo))}; fused paired {ms_p:.4f} ms "
          f"({3 * nbytes / ms_p / 1e6:.0f} GB/s as 2 reads + 1 write) vs scalar {ms_s:.4f} ms "
          f"({3 * nbytes / ms_s / 1e6:.0f} GB/s); loss paired {ms_loss:.4f} ms ({nbytes / ms_loss / 1e6:.0f} GB/s)")
    np.testing.assert_array_equal(bits(d), bits(d_s))
    np.testing.assert_array_equal(bits(lo), bits(lo_s))
    np.testing.assert_array_equal(bits(lo_only), bits(lo))
    assert np.all(bits(d)[:, V:] == 0) and not np.isnan(lo).any()
