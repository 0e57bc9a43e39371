"""AdamW: the reference against a straight transcription of the formula, the kernel against the reference,
weight decay only below decay_size."""
import math

import numpy as np
import pytest

from helpers import rel_err
from llmz.kernels.adamw import adamw_update, adamw_update_ref

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
