"""The classifier's fast kernels (llmz/fast/classifier.py: loss and dlogits in one kernel, in place over the
logits; the loss alone) against the fused reference and the teaching kernels (llmz/kernels/classifier.py):
the paired kernels the scalar ones' bits at twice the block, bf16 storage the float32 kernel's results rounded."""
import numpy as np
import pytest
from test_classifier import fused_ref64, random_inputs

from helpers import (
    NAN_BF16,
    assert_rounded_float32,
    assert_within_one_step,
    bits,
    gpu_ms_per_call,
    poisoned,
    rel_err,
    ulps_apart,
)
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.fast import classifier as fast
from llmz.fast.classifier import (
    classifier_fused,
    classifier_fused_kernel,
    classifier_fused_pairs_kernel,
    classifier_loss,
    classifier_loss_kernel,
    classifier_loss_pairs_kernel,
    row_block,
    row_pairs_apply,
)
from llmz.fast.device_helpers import pair_view
from llmz.kernels import classifier as teaching
from llmz.kernels.classifier import classifier_fused_ref

B, T, V, Vp = 2, 3, 50, 64


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


def test_classifier_fast_layers_match_the_teaching_layers(kdev, fdev, rng):
    logits, targets = random_inputs(rng)
    logits = logits.astype(np.float32)
    dloss = 1.0 / (B * T)
    got = {}
    for name, dev, k in (("teaching", kdev, teaching), ("fast", fdev, fast)):
        x, losses, only, t = dev.asarray(logits), poisoned(dev, (B, T)), poisoned(dev, (B, T)), dev.asarray(targets)
        k.classifier_loss(dev, only, x, t, V)
        np.testing.assert_array_equal(dev.to_host(x), logits)            # the loss leaves the logits alone
        k.classifier_fused(dev, losses, x, t, dloss, V)
        np.testing.assert_array_equal(dev.to_host(only), dev.to_host(losses))
        got[name] = dev.to_host(losses), dev.to_host(x)
    # float32 exponentials here, float64 in the teaching forward; the sums float64 in both
    assert rel_err(got["fast"][0], got["teaching"][0]) < 2e-6
    assert rel_err(got["fast"][1], got["teaching"][1]) < 2e-6
    assert np.all(got["fast"][1][..., V:] == 0)


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
def test_classifier_fused_kernel_matches_float64_reference_and_the_teaching_kernels_at_gpt2_size(kdev, fdev, rng):
    rows, V, Vp = 4096, 50257, 50304                           # d12's vocabulary, B*T = 4 x 1024 rows
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0].astype(np.float32), targets[0]
    t, dloss = fdev.asarray(targets), 1.0 / (3 * rows)
    ref_losses, ref_d = fused_ref64(logits, targets, dloss, V)
    # the fused layer twice, in place, losses NaN-poisoned: the same bits both times
    runs = []
    for _ in range(2):
        x, losses = fdev.asarray(logits), poisoned(fdev, rows)
        classifier_fused(fdev, losses, x, t, dloss, V)
        runs.append((fdev.to_host(losses), fdev.to_host(x)))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    losses, d = runs[0]
    assert np.all(d[:, V:] == 0)
    errs = {"losses": rel_err(losses, ref_losses), "dlogits": rel_err(d, ref_d)}
    worst = np.abs(d - ref_d) / np.maximum(np.abs(ref_d), np.finfo(np.float32).tiny)
    # the loss layer: the same loss bits
    only = poisoned(fdev, rows)
    classifier_loss(fdev, only, fdev.asarray(logits), t, V)
    np.testing.assert_array_equal(fdev.to_host(only), losses)
    # the teaching kernels (forward into probs, then backward): losses and dlogits a few ulps apart
    xt, t_losses = kdev.asarray(logits), poisoned(kdev, rows)
    teaching.classifier_fused(kdev, t_losses, xt, kdev.asarray(targets), dloss, V)
    un_d = kdev.to_host(xt)
    loss_ulps = ulps_apart(kdev.to_host(t_losses), losses)
    ulps = ulps_apart(d, un_d)
    # time: the fused kernel against the teaching pair it replaces, and the loss kernel (x keeps being
    # overwritten in place: the values change, the work does not)
    out, out_t, tt = poisoned(fdev, rows), poisoned(kdev, rows), kdev.asarray(targets)
    ms_fused = gpu_ms_per_call(fdev, lambda: classifier_fused(fdev, out, x, t, dloss, V))
    ms_loss = gpu_ms_per_call(fdev, lambda: classifier_loss(fdev, out, x, t, V))
    ms_pair = gpu_ms_per_call(kdev, lambda: teaching.classifier_fused(kdev, out_t, xt, tt, dloss, V))
    nbytes = rows * Vp * 4
    print(f"classifier fused rows={rows} V={V} Vp={Vp}: relative error {errs}, worst per element "
          f"{worst.max():.2e}; vs teaching: losses worst {loss_ulps.max()} ulp, dlogits worst {ulps.max()} ulp "
          f"({np.mean(ulps == 0):.4%} identical); fused {ms_fused:.4f} ms ({3 * nbytes / ms_fused / 1e6:.0f} GB/s "
          f"as 2 reads + 1 write), loss {ms_loss:.4f} ms ({nbytes / ms_loss / 1e6:.0f} GB/s), teaching pair "
          f"{ms_pair:.4f} ms per call")
    # float32 exps (<= 2 ulps) of exact x - m near the row max, float64 sums, one rounding of the dlogit
    assert max(errs.values()) < 1e-6
    assert rel_err(d, un_d) < 2e-6


@pytest.mark.gpu
def test_classifier_fused_kernel_on_bf16_is_the_rounded_float32_kernel_at_gpt2_size(fdev, rng):
    rows, V, Vp = 4096, 50257, 50304
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    bits, t, dloss = f32_to_bf16(logits[0]), fdev.asarray(targets[0]), 1.0 / (3 * rows)
    out = {}
    for name, host in (("bf16", bits), ("f32", bf16_to_f32(bits))):
        x, losses = fdev.asarray(host), fdev.full(rows, np.nan, np.float32)
        classifier_fused(fdev, losses, x, t, dloss, V)
        out[name] = (fdev.to_host(losses), fdev.to_host(x))
    (losses, d), (losses32, d32) = out["bf16"], out["f32"]
    x, scratch = fdev.asarray(bits), fdev.full(rows, np.nan, np.float32)
    ms = gpu_ms_per_call(fdev, lambda: classifier_fused(fdev, scratch, x, t, dloss, V))
    ms_loss = gpu_ms_per_call(fdev, lambda: classifier_loss(fdev, scratch, x, t, V))
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


def test_classifier_pairs_apply_only_to_even_rows_of_float32_or_bf16():
    f32, b16 = np.zeros((3, 40), np.float32), np.zeros((3, 40), np.uint16)
    assert row_pairs_apply(f32) and row_pairs_apply(b16)
    assert not row_pairs_apply(np.zeros((2, 41), np.float32))       # an even size, odd rows
    assert not row_pairs_apply(np.zeros((3, 40)))                   # float64
    assert not row_pairs_apply(np.zeros(81, np.float32)[1:].reshape(2, 40))    # starts at an odd element


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["float32", "bf16"])
def test_classifier_pairs_layers_are_the_scalar_kernels_bit_for_bit_at_d12_size(fdev, rng, storage):
    rows, V, Vp = 4096, 50257, 50304                           # d12's vocabulary, B*T = 4 x 1024 rows
    logits, _ = fused_inputs(rng, rows, V, Vp)
    targets, dloss = edge_targets(rng, rows, V), 1.0 / (3 * rows)
    kdev = fdev
    t, block = kdev.asarray(targets), row_block(fdev)
    host = storage_logits(logits, V, storage)
    # the layers (the paired kernels on a GPU, at half row_block's threads), then the scalar kernel at row_block,
    # each from NaN-poisoned losses
    x, losses, only = kdev.asarray(host), kdev.full(rows, np.nan, np.float32), kdev.full(rows, np.nan, np.float32)
    assert row_pairs_apply(x)
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
