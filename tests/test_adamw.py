"""AdamW (llmz/kernels/adamw.py, the teaching kernels): the reference against a straight transcription of the
formula, the kernels against the reference, weight decay only below decay_size, the bf16 update (fp32 master,
stochastic rounding). The paired bf16 kernel: tests/test_fast_adamw.py."""
import math

import numpy as np
import pytest

from helpers import rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.adamw import adamw_update, adamw_update_bf16, adamw_update_bf16_ref, adamw_update_ref

SEED = 1234

BETA1, BETA2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


def scalars_at(t, lr=3e-4, grad_scale=0.7):
    """[lr, grad_scale, 1 - beta1^t, 1 - beta2^t] for step t (1-based)."""
    return np.array([lr, grad_scale, 1 - BETA1**t, 1 - BETA2**t], dtype=np.float64)


def random_state(rng, n):
    params = rng.normal(size=n)
    m = rng.normal(size=n) * 1e-2                              # a run already under way: never zeros
    v = rng.random(size=n) * 1e-4 + 1e-6
    return params, m, v


def transcription(params, grads, m, v, decay_size, s, beta1, beta2, eps, weight_decay):
    """The formula element by element, in plain Python floats."""
    lr, grad_scale, bc1, bc2 = s
    for i in range(params.size):
        g = grads[i] * grad_scale
        m[i] = beta1 * m[i] + (1 - beta1) * g
        v[i] = beta2 * v[i] + (1 - beta2) * g * g
        m_hat = m[i] / bc1
        v_hat = v[i] / bc2
        wd = weight_decay if i < decay_size else 0.0
        params[i] -= lr * (m_hat / (math.sqrt(v_hat) + eps) + wd * params[i])


def test_adamw_reference_matches_formula_over_steps(rng):
    n, decay = 23, 15
    p, m, v = random_state(rng, n)
    q, mq, vq = p.copy(), m.copy(), v.copy()
    for t in range(1, 5):
        g = rng.normal(size=n)
        adamw_update_ref(p, g, m, v, decay, scalars_at(t), BETA1, BETA2, EPS, WD)
        transcription(q, g, mq, vq, decay, scalars_at(t), BETA1, BETA2, EPS, WD)
    # the same float64 operations, grouped slightly differently: a few ulps
    assert rel_err(p, q) < 1e-14 and rel_err(m, mq) < 1e-14 and rel_err(v, vq) < 1e-14


def test_adamw_reference_keeps_float32(rng):
    n = 100
    p, m, v = (a.astype(np.float32) for a in random_state(rng, n))
    p64, m64, v64 = (a.astype(np.float64) for a in (p, m, v))
    g = rng.normal(size=n)
    adamw_update_ref(p, g.astype(np.float32), m, v, 60, scalars_at(3), BETA1, BETA2, EPS, WD)
    adamw_update_ref(p64, g, m64, v64, 60, scalars_at(3), BETA1, BETA2, EPS, WD)
    assert p.dtype == m.dtype == v.dtype == np.float32
    # float32 arithmetic, a handful of roundings per element
    assert rel_err(p, p64) < 1e-6 and rel_err(m, m64) < 1e-6 and rel_err(v, v64) < 1e-6


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6),    # float32 storage of p, m, v after each step
                                        (np.float64, 1e-13)])
def test_adamw_kernel_matches_reference_over_steps(kdev, rng, dtype, tol):
    n, decay = 1000 + 7, 600                                   # not a multiple of the block size
    p, m, v = random_state(rng, n)
    dp, dm, dv = (kdev.asarray(a, dtype) for a in (p, m, v))
    for t in range(1, 4):
        g = rng.normal(size=n)
        adamw_update(kdev, dp, kdev.asarray(g, dtype), dm, dv, decay, kdev.asarray(scalars_at(t)),
                     BETA1, BETA2, EPS, WD)
        adamw_update_ref(p, g, m, v, decay, scalars_at(t), BETA1, BETA2, EPS, WD)
    assert rel_err(kdev.to_host(dp), p) < tol
    assert rel_err(kdev.to_host(dm), m) < tol
    assert rel_err(kdev.to_host(dv), v) < tol


def test_adamw_weight_decay_only_below_decay_size(kdev, rng):
    n, decay = 200 + 3, 77
    p, m, v = random_state(rng, n)
    g = rng.normal(size=n)
    results = []
    for wd in (0.0, WD):
        for run in ("kernel", "reference"):
            q, mq, vq = p.copy(), m.copy(), v.copy()
            if run == "kernel":
                dq = kdev.asarray(q)
                adamw_update(kdev, dq, kdev.asarray(g), kdev.asarray(mq), kdev.asarray(vq), decay,
                             kdev.asarray(scalars_at(2)), BETA1, BETA2, EPS, wd)
                q = kdev.to_host(dq)
            else:
                adamw_update_ref(q, g, mq, vq, decay, scalars_at(2), BETA1, BETA2, EPS, wd)
            results.append(q)
    for no_wd, with_wd in ((results[0], results[2]), (results[1], results[3])):
        assert np.array_equal(no_wd[decay:], with_wd[decay:])          # above decay_size: untouched by wd
        assert np.all(no_wd[:decay] != with_wd[:decay])               # below: every element decayed
        # decoupled decay: exactly lr * wd * p further towards zero
        assert np.allclose(no_wd[:decay] - with_wd[:decay], scalars_at(2)[0] * WD * p[:decay], rtol=1e-6)


@pytest.mark.gpu
def test_adamw_kernel_matches_float64_reference_at_gpt2_size(kdev, rng):
    n, decay = 124_475_904, 85_000_000
    p, m, v = random_state(rng, n)
    p, m, v = (a.astype(np.float32) for a in (p, m, v))
    g = rng.normal(size=n).astype(np.float32)
    dp, dm, dv = kdev.asarray(p), kdev.asarray(m), kdev.asarray(v)
    adamw_update(kdev, dp, kdev.asarray(g), dm, dv, decay, kdev.asarray(scalars_at(5)), BETA1, BETA2, EPS, WD)
    p64, m64, v64 = (a.astype(np.float64) for a in (p, m, v))
    adamw_update_ref(p64, g.astype(np.float64), m64, v64, decay, scalars_at(5), BETA1, BETA2, EPS, WD)
    errs = [rel_err(kdev.to_host(a), b) for a, b in ((dp, p64), (dm, m64), (dv, v64))]
    print(f"adamw n={n}: rel err params {errs[0]:.2e}, m {errs[1]:.2e}, v {errs[2]:.2e}")
    assert max(errs) < 1e-6                                     # float32 storage: about one ulp


# ---- the bf16 AdamW kernel ---------------------------------------------------------------------------
def scalars5_at(t, lr=3e-4, grad_scale=0.7):
    # [lr, grad_scale, bias corrections, the rounding's step]: here step t draws with step t
    return np.array([lr, grad_scale, 1 - BETA1**t, 1 - BETA2**t, t], dtype=np.float64)


def random_bf16_state(rng, n):
    master = rng.normal(size=n).astype(np.float32)
    m = (rng.normal(size=n) * 1e-2).astype(np.float32)                     # a run under way: never zeros
    v = (rng.random(size=n) * 1e-4 + 1e-6).astype(np.float32)
    return f32_to_bf16(master), master, m, v


def assert_same_update(kdev, got, want, what):
    """The simulator computes the float64 update exactly as NumPy does: equal bits. The GPU compiler
    contracts a*b + c into fused multiply-adds, which moves float64's last bit; where the float64 value
    lies on a float32 rounding tie (m = 0.9 m + 0.1 g with float32 m and bf16 g lands on ties far more
    often than chance: measured on the H200, 146,907 of 124,475,904 m values, 0.12%, each one float32 ulp
    from NumPy's, the float64 value within 1e-16 relative of the midpoint), the float32 store goes the
    other way. So: at most one ulp (bf16: one step) apart, in at most 0.5% of the elements."""
    if kdev.kind != "gpu":
        assert np.array_equal(got, want, equal_nan=True), what
        return
    step = np.abs(got.view(np.int32 if got.dtype == np.float32 else np.int16).astype(np.int64)
                  - want.view(np.int32 if want.dtype == np.float32 else np.int16).astype(np.int64))
    print(f"{what}: {np.count_nonzero(step)} of {got.size} differ, by at most {step.max()} ulp")
    assert step.max() <= 1 and np.count_nonzero(step) <= max(10, got.size // 200), what


@pytest.mark.parametrize("stochastic", [True, False])
def test_adamw_bf16_kernel_matches_reference_over_steps(kdev, rng, stochastic):
    n, decay = 1000 + 7, 600                                               # not a multiple of the block size
    params, master, m, v = random_bf16_state(rng, n)
    dev_state = [kdev.asarray(a) for a in (params, master, m, v)]
    for t in range(1, 4):
        g = f32_to_bf16(rng.normal(size=n))
        p_k, master_k, m_k, v_k = dev_state
        adamw_update_bf16(kdev, p_k, master_k, kdev.asarray(g), m_k, v_k, decay, kdev.asarray(scalars5_at(t)),
                          BETA1, BETA2, EPS, WD, SEED, stochastic, offset=1000)
        adamw_update_bf16_ref(params, master, g, m, v, decay, scalars5_at(t), BETA1, BETA2, EPS, WD, SEED,
                              stochastic, offset=1000)
    got = [kdev.to_host(a) for a in dev_state]
    for name, a, b in zip(("params", "master", "m", "v"), got, (params, master, m, v)):
        assert_same_update(kdev, a, b, name)
    # the bf16 parameters are the master weights rounded
    if stochastic:
        down = (master.view(np.uint32) >> 16).astype(np.int64)
        assert np.all((params == down) | (params == down + 1))
        assert 0.15 < np.mean(params != f32_to_bf16(master)) < 0.35        # min(p, 1-p): a quarter
    else:
        assert np.array_equal(params, f32_to_bf16(master))


def test_adamw_bf16_master_update_is_the_fp32_kernels_update(kdev, rng):
    # one formula: the fp32 kernel on float32 parameters equal to the master, with the bf16 gradients'
    # values, gives the master update of the bf16 kernel
    n, decay = 500 + 3, 300
    params, master, m, v = random_bf16_state(rng, n)
    g = f32_to_bf16(rng.normal(size=n))
    bf = [kdev.asarray(a) for a in (params, master, m, v)]
    adamw_update_bf16(kdev, bf[0], bf[1], kdev.asarray(g), bf[2], bf[3], decay, kdev.asarray(scalars5_at(2)),
                      BETA1, BETA2, EPS, WD, SEED)
    fp = [kdev.asarray(a) for a in (master, m, v)]
    adamw_update(kdev, fp[0], kdev.asarray(bf16_to_f32(g)), fp[1], fp[2], decay, kdev.asarray(scalars5_at(2)),
                 BETA1, BETA2, EPS, WD)
    for name, a, b in zip(("master", "m", "v"), bf[1:], fp):
        assert_same_update(kdev, kdev.to_host(a), kdev.to_host(b), name)


def test_adamw_bf16_reference_tracks_float64_adamw(rng):
    # the bf16 path's master weights follow float64 AdamW to float32 precision
    n, decay = 300, 200
    params, master, m, v = random_bf16_state(rng, n)
    p64, m64, v64 = master.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    for t in range(1, 6):
        g = f32_to_bf16(rng.normal(size=n))
        adamw_update_bf16_ref(params, master, g, m, v, decay, scalars5_at(t), BETA1, BETA2, EPS, WD, SEED)
        adamw_update_ref(p64, bf16_to_f32(g).astype(np.float64), m64, v64, decay, scalars5_at(t),
                         BETA1, BETA2, EPS, WD)
    # float32 storage of master, m and v after each of 5 steps
    assert rel_err(master, p64) < 1e-6 and rel_err(m, m64) < 1e-6 and rel_err(v, v64) < 1e-6
    # the bf16 copy: within one bf16 step (2^-7 relative) of the master
    assert np.all(np.abs(bf16_to_f32(params) - master) <= 2.0**-7 * np.abs(master))


@pytest.mark.gpu
def test_adamw_bf16_kernel_matches_reference_at_gpt2_size(kdev, rng):
    n, decay = 124_475_904, 85_000_000
    params, master, m, v = random_bf16_state(rng, n)
    g = f32_to_bf16(rng.normal(size=n) * 1e-2)
    dev_state = [kdev.asarray(a) for a in (params, master, m, v)]
    p_k, master_k, m_k, v_k = dev_state
    adamw_update_bf16(kdev, p_k, master_k, kdev.asarray(g), m_k, v_k, decay, kdev.asarray(scalars5_at(5)),
                      BETA1, BETA2, EPS, WD, SEED)
    adamw_update_bf16_ref(params, master, g, m, v, decay, scalars5_at(5), BETA1, BETA2, EPS, WD, SEED)
    for name, a, b in zip(("params", "master", "m", "v"), dev_state, (params, master, m, v)):
        assert_same_update(kdev, kdev.to_host(a), b, name)


