"""The candidate versions kept in dev/<layer>.py (16-byte units, dev/vectors.py; cuBLASLt, dev/cublaslt.py),
not yet run on a GPU, against the float64 references and the teaching kernels on fresh random inputs, in the
simulator (tiny shapes: a partial unit, strip or block each) and, GPU-marked, on a GPU. What llmz/fast/ runs
is tested in tests/test_fast_*.py; these keep the candidates right until tools/kern_gpu.sh measures them."""
import os
import sys
import threading

import numpy as np
import pytest
from test_adamw import BETA1, BETA2, EPS, SEED, WD, random_bf16_state, scalars5_at
from test_classifier import random_inputs
from test_fast_column_sum import lanes_model, teaching_bias
from test_layernorm import forward64, make_inputs

from helpers import (
    STORAGES,
    as_f64,
    assert_within_one_step,
    bits,
    nan_storage,
    poisoned,
    rand_bf16,
    rand_storage,
    rel_err,
    ulps_apart,
)
from llmz.bf16 import bf16_to_f32, f32_to_bf16, f32_to_bf16_stochastic
from llmz.fast.encoder import wte_buckets_upload
from llmz.kernels import encoder as teaching_encoder
from llmz.kernels import gelu as teaching_gelu
from llmz.kernels import layernorm as teaching_layernorm
from llmz.kernels import residual as teaching_residual
from llmz.kernels.adamw import adamw_update_bf16_ref
from llmz.kernels.classifier import classifier_fused_ref
from llmz.kernels.gelu import gelu_backward_ref, gelu_forward_ref
from llmz.kernels.grid import ceil_div
from llmz.kernels.layernorm import layernorm_backward_ref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # the repository root: dev/
from dev import adamw, classifier, column_sum, encoder, gelu, layernorm, matmul, residual


@pytest.fixture(autouse=True)
def quick_barriers():
    """The simulator's block manager busy-polls for every syncthreads: switching Python threads every 50 us
    instead of every 5 ms makes the kernels' barriers several times faster."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(interval)


# ---- GELU and residual (version 3: two units of 8 a thread) ---------------------------------------------------
# elements in the simulator (32-thread blocks, 2 units a thread: 512 a block): 296 less than a block, 520 one
# unit past a full block
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("n", [296, 520])
def test_gelu_units_match_float64_and_the_teaching_kernels(kdev, rng, storage, n):
    x, dout, start = (rand_storage(rng, n, storage, s) for s in (3.0, 1.0, 1.0))
    got, taught = [], []
    for layer, outs in ((gelu, got), (teaching_gelu, taught)):
        fwd = gelu.gelu_forward_units if layer is gelu else teaching_gelu.gelu_forward
        bwd = gelu.gelu_backward_units if layer is gelu else teaching_gelu.gelu_backward
        out, over, acc = nan_storage(kdev, n, storage), nan_storage(kdev, n, storage), kdev.asarray(start)
        xd, gd = kdev.asarray(x), kdev.asarray(dout)
        fwd(kdev, out, xd)
        bwd(kdev, acc, xd, gd)
        bwd(kdev, over, xd, gd, accumulate=False)
        outs.extend(kdev.to_host(a) for a in (out, acc, over))
    x64, g64 = as_f64(x), as_f64(dout)
    want = [np.empty(n), as_f64(start), np.empty(n)]
    gelu_forward_ref(want[0], x64)
    gelu_backward_ref(want[1], x64, g64)
    gelu_backward_ref(want[2], x64, g64, accumulate=False)
    for what, f, t, w in zip(("forward", "backward +=", "backward ="), got, taught, want):
        assert not np.isnan(as_f64(f)).any(), f"{what}: NaN left (an element not written)"
        if storage == "float32":
            # ex2.approx and rcp.approx: ~2 ulps each on the GPU (NumPy's exact functions in the simulator)
            assert rel_err(f, w) < 1e-6, what
        else:
            # the same value within float32 ulps, rounded once to bf16: at most a step apart
            assert_within_one_step(f, t, atol=1e-6)


def test_gelu_units_are_finite_and_right_far_out(kdev):
    # large |x|: exp(-2u) is capped (no inf * 0); gelu(x) -> 0 and x, gelu'(x) -> 0 and 1
    x = np.array([-1e4, -300, -60, -20, -5, -1e-3, 0, 1e-3, 5, 20, 60, 300, 1e4, -0.5, 0.5, 2], np.float32)
    out, d = kdev.full(16, np.nan, np.float32), kdev.full(16, np.nan, np.float32)
    gelu.gelu_forward_units(kdev, out, kdev.asarray(x))
    gelu.gelu_backward_units(kdev, d, kdev.asarray(x), kdev.asarray(np.ones(16, np.float32)), accumulate=False)
    want, dwant = np.empty(16), np.empty(16)
    gelu_forward_ref(want, x.astype(np.float64))
    gelu_backward_ref(dwant, x.astype(np.float64), np.ones(16), accumulate=False)
    got, dgot = kdev.to_host(out), kdev.to_host(d)
    assert np.isfinite(got).all() and np.isfinite(dgot).all()
    # in the tail (x = -5: gelu ~ -2e-7) exp's float32 argument (~ -23) carries its rounding into the result,
    # ~1e-6 relative; elsewhere a few ulps
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-30)
    np.testing.assert_allclose(dgot, dwant, rtol=4e-6, atol=1e-20)


@pytest.mark.parametrize("storage", STORAGES)
def test_residual_units_are_the_teaching_kernels_bit_for_bit(kdev, rng, storage):
    n = 520
    a, b, dout, s1, s2 = (kdev.asarray(rand_storage(rng, n, storage)) for _ in range(5))
    outs = {}
    for name, fwd, bwd in (("units", residual.residual_forward_units, residual.residual_backward_units),
                           ("teaching", teaching_residual.residual_forward, teaching_residual.residual_backward)):
        out, d1, d2 = nan_storage(kdev, n, storage), s1.copy(), s2.copy()
        fwd(kdev, out, a, b)
        bwd(kdev, d1, d2, dout)
        outs[name] = [bits(kdev.to_host(x)) for x in (out, d1, d2)]
    for what, u, t in zip(("forward", "dinp1", "dinp2"), outs["units"], outs["teaching"]):
        np.testing.assert_array_equal(u, t, err_msg=what)


def test_elementwise_units_take_the_teaching_kernel_off_16_bytes(kdev, rng, launched):
    # a float32 and a bf16 input into bf16 (one and two 16-byte loads a unit); then a view off 16 bytes
    a, b = (kdev.asarray(rand_storage(rng, 8 * 37 + 1, s)) for s in STORAGES)
    out = nan_storage(kdev, 8 * 37 + 1, "bf16")
    names = launched(kdev)
    residual.residual_forward_units(kdev, out[:8 * 37], a[:8 * 37], b[:8 * 37])
    residual.residual_forward_units(kdev, out[1:], a[1:], b[1:])
    gelu.gelu_forward_units(kdev, out[2:42], a[2:42])
    assert names == ["residual_forward_units_kernel", "residual_forward_kernel", "gelu_forward_kernel"]
    sums = f32_to_bf16(kdev.to_host(a)[1:] + bf16_to_f32(kdev.to_host(b)[1:]))
    np.testing.assert_array_equal(kdev.to_host(out)[42:], sums[41:])


# ---- AdamW (version 3: a unit a thread, float32) ------------------------------------------------------------
def check_adamw_step(got, state, g, decay, t, stochastic, offset):
    """master, m, v against the float64 update (within a few float32 ulps of the terms they are made of);
    params exactly the host's rounding of the kernel's master (the same random word per element)."""
    params, master, m, v = (a.copy() for a in state)
    adamw_update_bf16_ref(params, master, g, m, v, decay, scalars5_at(t), BETA1, BETA2, EPS, WD, SEED, stochastic,
                          offset)
    g32 = bf16_to_f32(g).astype(np.float64) * scalars5_at(t)[1]
    terms = {"master": np.abs(state[1]) + np.abs(state[1] - master),
             "m": BETA1 * np.abs(state[2]) + (1 - BETA1) * np.abs(g32), "v": np.abs(v)}
    for name, a, b in zip(("master", "m", "v"), got[1:], (master, m, v)):
        assert rel_err(a, b) < 1e-6, name
        assert np.all(np.abs(a.astype(np.float64) - b) <= 4 * 2.0 ** -24 * terms[name]), name
    want = f32_to_bf16_stochastic(got[1], SEED, t, offset) if stochastic else f32_to_bf16(got[1])
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("stochastic", [True, False])
def test_adamw_units_match_the_float64_update(kdev, rng, launched, stochastic):
    # 296 elements: 37 units, two 32-thread blocks; decay_size odd (a unit straddles it); a ZeRO-like offset.
    # Then views: at unit 1 (the units), off 16 bytes and not whole units (the teaching kernel)
    n, decay, offset = 296, 8 * 12 + 3, 1001
    state = random_bf16_state(rng, n)
    g = f32_to_bf16(rng.normal(size=n))
    names = launched(kdev)
    for start, size in ((0, n), (8, 88), (2, 80), (0, 79)):
        bufs = [kdev.asarray(a) for a in state]
        bufs[0][...] = 0x7FC0                                          # params only written: NaN first
        p, master, m, v = (b[start:start + size] for b in bufs)
        adamw.adamw_update_bf16_units(kdev, p, master, kdev.asarray(g)[start:start + size], m, v, decay,
                                      kdev.asarray(scalars5_at(3)), BETA1, BETA2, EPS, WD, SEED, stochastic,
                                      offset + start)
        got = [kdev.to_host(a) for a in (p, master, m, v)]
        check_adamw_step(got, [a[start:start + size] for a in state], g[start:start + size], decay, 3,
                         stochastic, offset + start)
    assert names == ["adamw_bf16_units_kernel"] * 2 + ["adamw_bf16_kernel"] * 2


# ---- column sums (version 3: 256-column strips of units) ------------------------------------------------------
def fixed_order_sums(dev, start, x, rows):
    """start + the column sums of x in the documented order (stage 1 per chunk, stage 2 over the partials),
    one float32 rounding."""
    _, block, R, rows = column_sum.colsum_geometry(dev, x.shape[0], x.shape[1], rows)
    x64 = x.astype(np.float64)
    partial = np.stack([lanes_model(x64, y * rows, min((y + 1) * rows, x.shape[0]), block[1]) for y in range(R)])
    return (start.astype(np.float64) + lanes_model(partial, 0, R, block[1])).astype(np.float32)


# (37,48): 6 units (a partial strip), N not a multiple of the chunk; rows_per_block 5: a chunk not a multiple
# of the lanes; 1: 37 partials for stage 2; (70,264): two strips, the second one unit wide
@pytest.mark.parametrize("shape, rows_per_block", [((37, 48), None), ((37, 48), 5), ((37, 24), 1), ((70, 264), None)])
def test_column_sum_units_add_in_the_fixed_order(kdev, rng, shape, rows_per_block):
    x = (rng.normal(size=shape) * 10 ** rng.uniform(-3, 3, size=(shape[0], 1))).astype(np.float32)  # order shows
    start = rng.normal(size=shape[1]).astype(np.float32)
    out = kdev.asarray(start)
    column_sum.column_sum_units(kdev, out, kdev.asarray(x), rows_per_block=rows_per_block)
    got = kdev.to_host(out)
    np.testing.assert_array_equal(got, fixed_order_sums(kdev, start, x, rows_per_block))
    # the teaching kernel: the same float64 sum in another order, one rounding: at most an ulp apart
    assert ulps_apart(got, teaching_bias(kdev, start, x)).max() <= 1
    grid = column_sum.colsum_geometry(kdev, *shape, rows_per_block)[0]
    np.testing.assert_array_equal(kdev.to_host(kdev.scratch("colsum_count", grid[0], np.int32)), 0)


def test_column_sum_units_bits_do_not_depend_on_which_block_finishes_last(kdev, rng, monkeypatch):
    # (37,264) in chunks of 8 rows, two strips: each strip's last block is its last chunk in grid order, chunk 0
    # in reversed order; the documented order's bits either way (the simulator runs blocks one at a time)
    from numba.cuda.simulator import kernel as simulator
    if kdev.kind != "sim":
        pytest.skip("changes the simulator's block order")
    N, C, rows = 37, 264, 8
    x = (rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))).astype(np.float32)
    start = rng.normal(size=C).astype(np.float32)
    R = column_sum.colsum_geometry(kdev, N, C, rows)[2]
    want = fixed_order_sums(kdev, start, x, rows)
    for order, lasts_want in (("grid", [(0, R - 1), (1, R - 1)]), ("reversed", [(0, 0), (1, 0)])):
        monkeypatch.undo()
        numpy_with_order = type("NumpyWithOrder", (), {"__getattr__": lambda self, name: getattr(np, name)})()
        numpy_with_order.ndindex = (lambda *shape: list(np.ndindex(*shape))[::-1]) if order == "reversed" \
            else np.ndindex
        monkeypatch.setattr(simulator, "np", numpy_with_order)
        lasts, last_in_strip = [], column_sum.last_in_strip

        def recording(flag, counters, lasts=lasts, last_in_strip=last_in_strip):
            last = last_in_strip(flag, counters)
            t = threading.current_thread()
            if last and t.threadIdx.x == 0 and t.threadIdx.y == 0:
                lasts.append((t.blockIdx.x, t.blockIdx.y))
            return last
        monkeypatch.setattr(column_sum, "last_in_strip", recording)
        out = kdev.asarray(start)
        column_sum.column_sum_units(kdev, out, kdev.asarray(x), rows_per_block=rows)
        assert sorted(lasts) == lasts_want
        np.testing.assert_array_equal(kdev.to_host(out), want)


def test_column_sum_units_split_the_columns_and_fall_back_to_the_teaching_kernel(kdev, rng, launched):
    # layernorm's (G, 2C) partials: columns < C into dweight, the rest into dbias; C = 45 (not whole units) and
    # bf16 sums into a bf16 out
    G, C = 21, 40
    x = rng.normal(size=(G, 2 * C)).astype(np.float32)
    starts = [rng.normal(size=C).astype(np.float32) for _ in range(2)]
    lo, hi = (kdev.asarray(s) for s in starts)
    names = launched(kdev)
    column_sum.column_sum_into(kdev, lo, hi, kdev.asarray(x))
    want = np.concatenate(starts).astype(np.float64) + x.astype(np.float64).sum(axis=0)
    assert rel_err(kdev.to_host(lo), want[:C]) < 1e-6 and rel_err(kdev.to_host(hi), want[C:]) < 1e-6
    x45, s45 = rng.normal(size=(9, 45)).astype(np.float32), rng.normal(size=45).astype(np.float32)
    out = kdev.asarray(s45)
    column_sum.column_sum_units(kdev, out, kdev.asarray(x45))
    assert rel_err(kdev.to_host(out), s45 + x45.astype(np.float64).sum(axis=0)) < 1e-6
    xb, sb = rand_bf16(rng, (37, 48)), rand_bf16(rng, 48)
    out = kdev.asarray(sb)
    column_sum.column_sum_units(kdev, out, kdev.asarray(xb))
    # the same float64 sum in another order, rounded once to bf16: within one bf16 step
    assert_within_one_step(kdev.to_host(out), teaching_bias(kdev, sb, xb), atol=1e-4)
    assert names == ["column_sum_units_kernel", "matmul_backward_bias_kernel",       # the split, C = 45
                     "column_sum_units_kernel", "matmul_backward_bias_kernel"]      # bf16, teaching_bias's


# ---- layernorm (versions 3 and 4: per-C kernels on units, the fused residual) ---------------------------------
def forward_backward(dev, shape, inp, weight, bias, dout, starts):
    """The candidate forward into NaN-poisoned outputs, then its backward from random non-zero gradients."""
    x, w, b, dy = (dev.asarray(a) for a in (inp, weight, bias, dout))
    out, mean, rstd = poisoned(dev, shape), poisoned(dev, shape[:1]), poisoned(dev, shape[:1])
    layernorm.layernorm_forward_units(dev, out, mean, rstd, x, w, b)
    grads = [dev.asarray(a) for a in starts]
    layernorm.layernorm_backward_units(dev, *grads, dy, x, w, mean, rstd)
    return [dev.to_host(a) for a in (out, mean, rstd, *grads)]


# (7,40): odd rows (a warp with no row), 5 units; (3,264): 33 units, a lane with a second unit (forward) and
# a team thread with a second unit (backward); (5,45): not whole units, the teaching kernels
@pytest.mark.parametrize("shape, kernels", [((7, 40), ["layernorm_forward_units_kernel",
                                                       "layernorm_backward_units_kernel", "column_sum_units_kernel"]),
                                            ((3, 264), None),
                                            ((5, 45), ["layernorm_forward_kernel", "layernorm_backward_inp_kernel",
                                                       "layernorm_backward_params_kernel"])])
def test_layernorm_units_match_the_float64_reference(kdev, rng, launched, shape, kernels):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    dout = rng.normal(size=shape).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, shape[1], shape[1])]
    names = launched(kdev)
    out, mean, rstd, *grads = forward_backward(kdev, shape, inp, weight, bias, dout, starts)
    assert kernels is None or names == kernels
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    want = [a.astype(np.float64) for a in starts]
    layernorm_backward_ref(*want, dout.astype(np.float64), inp.astype(np.float64), weight.astype(np.float64),
                           mean.astype(np.float64), rstd.astype(np.float64))
    # float32 sums per lane / thread and float64 across them; dweight, dbias float32 over each team's rows, then
    # float64: a few ulps, 1e-6 normwise leaves a wide margin
    for name, got, r in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"), (out, mean, rstd, *grads),
                            (*ref, *want)):
        assert rel_err(got, r) < 1e-6, name


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_residual_layernorm_forward_is_the_residual_then_the_layernorm_bit_for_bit(kdev, rng, bf16):
    shape = (7, 40)
    storage = "bf16" if bf16 else "float32"
    inp1, inp2, weight, bias = (rand_storage(rng, s, storage) for s in (shape, shape, shape[1], shape[1]))
    a, b2, w, b = (kdev.asarray(v) for v in (inp1, inp2, weight, bias))
    fused = [nan_storage(kdev, shape, storage), nan_storage(kdev, shape, storage),
             poisoned(kdev, shape[0], np.float32), poisoned(kdev, shape[0], np.float32)]
    layernorm.residual_layernorm_forward(kdev, *fused, a, b2, w, b)
    apart = [nan_storage(kdev, shape, storage), nan_storage(kdev, shape, storage),
             poisoned(kdev, shape[0], np.float32), poisoned(kdev, shape[0], np.float32)]
    teaching_residual.residual_forward(kdev, apart[0], a, b2)
    layernorm.layernorm_forward_units(kdev, apart[1], apart[2], apart[3], apart[0], w, b)
    for name, f, t in zip(("residual", "out", "mean", "rstd"), fused, apart):
        np.testing.assert_array_equal(kdev.to_host(f), kdev.to_host(t), err_msg=name)
    # and the reference: residual rounded to the storage, then layernorm_forward in float64
    ref = forward64(as_f64(kdev.to_host(fused[0])), as_f64(weight), as_f64(bias))
    assert rel_err(as_f64(kdev.to_host(fused[1])), ref[0]) < (4e-3 if bf16 else 1e-6)


def test_layernorm_backward_teams_bound_the_rows_a_team_adds_in_float32():
    for N, C in ((16384, 768), (8192, 1024), (8192, 1280), (8192, 1600), (4096, 768), (5, 16), (1, 8)):
        G = layernorm.backward_teams(N, C)
        assert 1 <= G <= N and -(-N // G) <= layernorm.TEAM_ROWS
        assert layernorm.team_warps(C) * 32 * layernorm.VPT * 8 >= C         # a team holds a whole row


def test_layernorm_units_match_the_teaching_layers(kdev, rng):
    shape = (9, 80)
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    dout = rng.normal(size=shape).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, shape[1], shape[1])]
    got = forward_backward(kdev, shape, inp, weight, bias, dout, starts)
    x, w, b, dy = (kdev.asarray(a) for a in (inp, weight, bias, dout))
    out, mean, rstd = poisoned(kdev, shape), poisoned(kdev, 9), poisoned(kdev, 9)
    teaching_layernorm.layernorm_forward(kdev, out, mean, rstd, x, w, b)
    grads = [kdev.asarray(a) for a in starts]
    teaching_layernorm.layernorm_backward(kdev, *grads, dy, x, w, mean, rstd)
    # not the same bits (the sums group differently): both within a few float32 ulps of float64
    for what, t, f in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"),
                          [kdev.to_host(a) for a in (out, mean, rstd, *grads)], got):
        assert rel_err(f, t) < 2e-6, what


# ---- the classifier (version 3: bf16 rows in registers) -------------------------------------------------------
# (3, 50, 64): V not a multiple of 8 (a padded unit half real), one unit a thread in the simulator's 32-thread
# block; (2, 300, 320): 40 units, a second unit for the first 8 threads; a target on the last real column
@pytest.mark.parametrize("rows, V, Vp", [(3, 50, 64), (2, 300, 320)])
def test_classifier_units_match_the_float64_fused_reference(kdev, rng, launched, rows, V, Vp):
    logits, targets = random_inputs(rng, 1, rows, V, Vp)
    logits, targets = logits[0], targets[0]
    targets[-1] = V - 1
    x = f32_to_bf16(logits)
    dloss = 1.0 / rows
    want_losses, want_d = np.empty(rows), bf16_to_f32(x).astype(np.float64)
    classifier_fused_ref(want_losses, want_d, targets, dloss, V)
    xd, losses = kdev.asarray(x), poisoned(kdev, rows, np.float32)
    names = launched(kdev)
    classifier.classifier_fused_units(kdev, losses, xd, kdev.asarray(targets), dloss, V)
    assert names == ["classifier_units_kernel"]
    # float32 exponentials (ex2.approx on the GPU), float32 sums a thread, float64 across: ~1e-7
    assert rel_err(kdev.to_host(losses), want_losses) < 1e-6
    got = kdev.to_host(xd)
    assert_within_one_step(got, f32_to_bf16(want_d.astype(np.float32)), atol=1e-7)
    assert not np.any(bf16_to_f32(got)[:, V:]), "padded columns must get a zero gradient"
    # the losses alone: the same losses, the logits untouched
    xd2, losses2 = kdev.asarray(x), poisoned(kdev, rows, np.float32)
    classifier.classifier_loss_units(kdev, losses2, xd2, kdev.asarray(targets), V)
    np.testing.assert_array_equal(kdev.to_host(losses2), kdev.to_host(losses))
    np.testing.assert_array_equal(kdev.to_host(xd2), x)


# ---- the encoder (version 3: units) ----------------------------------------------------------------------------
# (4,8) over 5 ids (runs longer than the wte kernel's 4 warps x 4 in flight), C = 48 (6 units); (2,3) over 1000
# ids (runs of one), C = 264 (a second strip of 32 units in the wte kernel's grid)
@pytest.mark.parametrize("shape, vocab, c, storage", [((4, 8), 5, 48, "float32"), ((2, 3), 1000, 264, "bf16")])
def test_encoder_units_match_the_reference_and_repeat(kdev, rng, launched, shape, vocab, c, storage):
    B, T = shape
    tokens = rng.integers(0, vocab, size=shape).astype(np.int32)
    wte, wpe, dout, dwte0, dwpe0 = (rand_storage(rng, s, storage)
                                    for s in ((vocab, c), (T + 2, c), (B, T, c), (vocab, c), (T + 2, c)))
    names = launched(kdev)
    out = nan_storage(kdev, (B, T, c), storage)
    encoder.encoder_forward_units(kdev, out, kdev.asarray(tokens), kdev.asarray(wte), kdev.asarray(wpe))
    want = np.empty((B, T, c))
    teaching_encoder.encoder_forward_ref(want, tokens, as_f64(wte), as_f64(wpe))
    # the same add as the teaching kernel, one rounding: its bits
    want = want.astype(np.float32)
    np.testing.assert_array_equal(kdev.to_host(out), f32_to_bf16(want) if storage == "bf16" else want)
    buckets = wte_buckets_upload(kdev, tokens)
    runs = []
    for _ in range(2):
        dwte, dwpe = kdev.asarray(dwte0), kdev.asarray(dwpe0)
        encoder.encoder_backward_units(kdev, dwte, dwpe, kdev.asarray(dout), kdev.asarray(tokens), buckets)
        runs.append((kdev.to_host(dwte), kdev.to_host(dwpe)))
    assert names[:3] == ["encoder_forward_units_kernel", "encoder_backward_wpe_units_kernel",
                         "encoder_backward_wte_units_kernel"]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    ref_wte, ref_wpe = as_f64(dwte0), as_f64(dwpe0)
    teaching_encoder.encoder_backward_ref(ref_wte, ref_wpe, as_f64(dout), tokens)
    if storage == "float32":
        # float64 sums of each token's (position's) rows, rounded once with the start: an ulp or so
        assert rel_err(runs[0][0], ref_wte) < 1e-6 and rel_err(runs[0][1], ref_wpe) < 1e-6
    else:
        assert_within_one_step(runs[0][0], f32_to_bf16(ref_wte.astype(np.float32)), atol=1e-6)
        assert_within_one_step(runs[0][1], f32_to_bf16(ref_wpe.astype(np.float32)), atol=1e-6)


# ---- the bias fill on units (dev/matmul.py's version 2) -------------------------------------------------------
@pytest.mark.parametrize("storage", STORAGES)
def test_matmul_bias_fill_units_writes_the_bias_bits_into_every_row(kdev, rng, storage):
    # OC = 264: 33 units, past one 32-thread block of units; N = 40: two row blocks of FILL_ROWS = 32
    N, OC = 40, 264
    bias = rand_storage(rng, OC, storage)
    out = nan_storage(kdev, (N, OC), storage)
    threads = kdev.block_size
    kdev.launch(matmul.matmul_bias_fill_units_kernel, (ceil_div(N, matmul.FILL_ROWS), ceil_div(OC // 8, threads)),
                threads, out.reshape(-1), kdev.asarray(bias), OC)
    np.testing.assert_array_equal(bits(kdev.to_host(out)), bits(np.broadcast_to(bias, (N, OC))))


# ---- cuBLASLt (dev/cublaslt.py; a GPU only) ----------------------------------------------------------------
# bf16 products accumulate in float32 and round once: 1e-2 relative (normwise) is a few bf16 roundings
N_LT, C_LT, OC_LT = 512, 256, 384                 # rows, inputs, outputs (multiples of 8, as the epilogues need)


@pytest.fixture(scope="module")
def bdev():
    from llmz.device import Device
    return Device("gpu", np.uint16, kernel_set="fast")


@pytest.mark.gpu
def test_cublaslt_bias_and_gelu_aux_bias_match_float64(bdev, rng):
    from dev.cublaslt import matmul_lt
    inp, w, b = rand_bf16(rng, (N_LT, C_LT)), rand_bf16(rng, (OC_LT, C_LT), 0.1), rand_bf16(rng, OC_LT)
    pre = as_f64(inp) @ as_f64(w).T + as_f64(b)
    out = bdev.zeros((N_LT, OC_LT), np.uint16)
    matmul_lt(bdev, out, bdev.asarray(inp), bdev.asarray(w), False, True, False, "bias", bias=bdev.asarray(b))
    assert rel_err(as_f64(bdev.to_host(out)), pre) < 1e-2
    aux, act = bdev.zeros((N_LT, OC_LT), np.uint16), bdev.zeros((N_LT, OC_LT), np.uint16)
    matmul_lt(bdev, act, bdev.asarray(inp), bdev.asarray(w), False, True, False, "gelu_aux_bias",
              bias=bdev.asarray(b), aux=aux)
    g = np.empty_like(pre)
    gelu_forward_ref(g, pre)
    assert rel_err(as_f64(bdev.to_host(aux)), pre) < 1e-2
    assert rel_err(as_f64(bdev.to_host(act)), g) < 1e-2


@pytest.mark.gpu
def test_cublaslt_dgelu_and_bgrad_epilogues_match_float64(bdev, rng):
    from dev.cublaslt import matmul_lt
    dout, wp, pre = rand_bf16(rng, (N_LT, C_LT)), rand_bf16(rng, (C_LT, OC_LT), 0.1), rand_bf16(rng, (N_LT, OC_LT))
    want = np.empty((N_LT, OC_LT))
    gelu_backward_ref(want, as_f64(pre), as_f64(dout) @ as_f64(wp), accumulate=False)
    for epilogue in ("dgelu", "dgelu_bgrad"):
        d, db = bdev.zeros((N_LT, OC_LT), np.uint16), bdev.zeros(OC_LT, np.uint16)
        matmul_lt(bdev, d, bdev.asarray(dout), bdev.asarray(wp), False, False, False, epilogue,
                  aux=bdev.asarray(pre), bias=db if epilogue == "dgelu_bgrad" else None)
        assert rel_err(as_f64(bdev.to_host(d)), want) < 1e-2, epilogue
        if epilogue == "dgelu_bgrad":
            assert rel_err(as_f64(bdev.to_host(db)), as_f64(bdev.to_host(d)).sum(axis=0)) < 1e-2
    # the weight gradient with the bias gradient: dW (+)= dout.T @ inp, dbias = column sums of dout
    g3, inp, dw0 = rand_bf16(rng, (N_LT, OC_LT)), rand_bf16(rng, (N_LT, C_LT)), rand_bf16(rng, (OC_LT, C_LT))
    dw, dbias = bdev.asarray(dw0), bdev.zeros(OC_LT, np.uint16)
    matmul_lt(bdev, dw, bdev.asarray(g3), bdev.asarray(inp), True, False, True, "bgradb", bias=dbias)
    assert rel_err(as_f64(bdev.to_host(dw)), as_f64(dw0) + as_f64(g3).T @ as_f64(inp)) < 1e-2
    assert rel_err(as_f64(bdev.to_host(dbias)), as_f64(g3).sum(axis=0)) < 1e-2
