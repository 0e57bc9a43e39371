"""Attention: the kernels against the NumPy reference, the reference against finite differences, causality."""
import numpy as np
import pytest

from helpers import finite_diff, poisoned, rel_err
from llmz.kernels.attention import (
    attention_backward,
    attention_backward_ref,
    attention_forward,
    attention_forward_ref,
)

B, T, C, NH = 2, 5, 12, 3          # head size 4


def _forward_ref(inp, NH):
    """float64 reference forward: (out, preatt, att)."""
    B, T, C3 = inp.shape
    out, preatt, att = np.empty((B, T, C3 // 3)), np.empty((B, NH, T, T)), np.empty((B, NH, T, T))
    attention_forward_ref(out, preatt, att, inp, NH)
    return out, preatt, att


def _forward_kernel(kdev, inp, NH):
    """float32 kernel forward on poisoned outputs: (out, preatt, att) on the host."""
    B, T, C3 = inp.shape
    out, preatt, att = poisoned(kdev, (B, T, C3 // 3)), poisoned(kdev, (B, NH, T, T)), poisoned(kdev, (B, NH, T, T))
    attention_forward(kdev, out, preatt, att, kdev.asarray(inp, np.float32), NH)
    return tuple(kdev.to_host(x) for x in (out, preatt, att))


def test_attention_forward_kernel_matches_reference(kdev, rng):
    inp = rng.normal(size=(B, T, 3 * C))
    got = _forward_kernel(kdev, inp, NH)
    want = _forward_ref(inp, NH)
    # float32 inputs, dot products of 4 terms, float32 exp and sums of at most 5 terms: a few ulps
    for name, g, w in zip(("out", "preatt", "att"), got, want):
        assert rel_err(g, w) < 1e-6, name
    # above the diagonal: exactly 0 in preatt and att; each att row sums to 1
    upper = np.triu(np.ones((T, T), dtype=bool), k=1)
    assert np.all(got[1][..., upper] == 0) and np.all(got[2][..., upper] == 0)
    assert np.allclose(got[2].sum(axis=-1), 1, atol=1e-6)


def test_attention_softmax_kernel_subtracts_the_max_so_large_scores_stay_finite(kdev, rng):
    inp = rng.normal(size=(B, T, 3 * C)) * 30          # scores of order 1e3: exp would overflow float32
    got = _forward_kernel(kdev, inp, NH)
    want = _forward_ref(inp, NH)
    assert np.all(np.isfinite(got[2])) and np.allclose(got[2].sum(axis=-1), 1, atol=1e-6)
    # scores ~1e3 rounded to float32 carry absolute errors ~1e-4 into the exponent
    assert rel_err(got[2], want[2]) < 1e-3


def test_attention_backward_kernel_matches_reference_and_overwrites_scratch(kdev, rng):
    inp = rng.normal(size=(B, T, 3 * C))
    dout = rng.normal(size=(B, T, C))
    att = _forward_ref(inp, NH)[2]
    dinp0 = rng.normal(size=inp.shape)                     # dinp accumulates: start non-zero
    dinp = kdev.asarray(dinp0, np.float32)
    dpreatt, datt = poisoned(kdev, att.shape), poisoned(kdev, att.shape)    # scratch: overwritten
    attention_backward(kdev, dinp, dpreatt, datt, kdev.asarray(dout, np.float32),
                       kdev.asarray(inp, np.float32), kdev.asarray(att, np.float32), NH)
    rdinp, rdpreatt, rdatt = dinp0.copy(), np.empty(att.shape), np.empty(att.shape)
    attention_backward_ref(rdinp, rdpreatt, rdatt, dout, inp, att, NH)
    # float32 inputs, sums of at most 5 terms per step: a few ulps
    assert rel_err(kdev.to_host(dinp), rdinp) < 1e-6
    assert rel_err(kdev.to_host(datt), rdatt) < 1e-6
    assert rel_err(kdev.to_host(dpreatt), rdpreatt) < 1e-6


@pytest.mark.parametrize("path", ["direct", "gemm"])
def test_attention_backward_overwrites_dinp_when_asked(kdev, fdev, rng, path):
    dev = kdev if path == "direct" else fdev
    inp = rng.normal(size=(B, T, 3 * C))
    dout = rng.normal(size=(B, T, C))
    _, _, att, qkvr = _forward_fast(fdev, inp, NH) if path == "gemm" else (None, None, None, None)
    att_h = _forward_ref(inp, NH)[2] if path == "direct" else fdev.to_host(att).astype(np.float64)
    # dinp starts as NaN: a kernel that read it (accumulated) would leave NaN
    dinp = poisoned(dev, inp.shape)
    dpreatt, datt = poisoned(dev, att_h.shape), poisoned(dev, att_h.shape)
    attention_backward(dev, dinp, dpreatt, datt, dev.asarray(dout, np.float32), dev.asarray(inp, np.float32),
                       dev.asarray(att_h, np.float32), NH, qkvr, accumulate=False)
    rdinp = np.full(inp.shape, np.nan)
    attention_backward_ref(rdinp, np.empty(att_h.shape), np.empty(att_h.shape), dout, inp, att_h, NH,
                           accumulate=False)
    # as the accumulating tests: a few ulps (TF32 on a GPU: ~1e-3)
    assert rel_err(dev.to_host(dinp), rdinp) < (5e-3 if dev.matmul == "cublas" else 1e-6)


def test_attention_reference_backward_matches_finite_differences(rng):
    inp = rng.normal(size=(B, T, 3 * C))
    dout = rng.normal(size=(B, T, C))
    att = _forward_ref(inp, NH)[2]
    dinp = np.zeros_like(inp)
    attention_backward_ref(dinp, np.empty(att.shape), np.empty(att.shape), dout, inp, att, NH)
    idx, g = finite_diff(lambda x: _forward_ref(x, NH)[0], inp, dout)
    assert rel_err(dinp.reshape(-1)[idx], g) < 1e-6


@pytest.mark.parametrize("t", [0, 2])
def test_attention_output_at_t_does_not_depend_on_later_positions(kdev, rng, t):
    inp = rng.normal(size=(B, T, 3 * C))
    later = inp.copy()
    later[:, t + 1:] = rng.normal(size=later[:, t + 1:].shape) * 10    # change q, k, v after position t
    for run in (lambda x: _forward_ref(x, NH), lambda x: _forward_kernel(kdev, x, NH)):
        a, b = run(inp)[0], run(later)[0]
        # positions <= t see exactly the same numbers in the same order: bit-identical
        assert np.array_equal(a[:, :t + 1], b[:, :t + 1])
        assert not np.allclose(a[:, t + 1:], b[:, t + 1:])


# ---- real GPU, GPT-2 124M sizes -------------------------------------------------------------------
@pytest.mark.gpu
def test_attention_kernels_match_float64_reference_at_gpt2_size(kdev, rng):
    B, T, C, NH = 4, 1024, 768, 12
    inp = rng.normal(size=(B, T, 3 * C)).astype(np.float32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    got = _forward_kernel(kdev, inp, NH)
    want = _forward_ref(inp.astype(np.float64), NH)
    err = {name: rel_err(g, w) for name, g, w in zip(("out", "preatt", "att"), got, want)}
    att32 = got[2]
    del got
    dinp = kdev.zeros(inp.shape)
    dpreatt, datt = poisoned(kdev, att32.shape), poisoned(kdev, att32.shape)
    attention_backward(kdev, dinp, dpreatt, datt, kdev.asarray(dout), kdev.asarray(inp), kdev.asarray(att32), NH)
    rdinp, rdpreatt, rdatt = np.zeros(inp.shape), np.empty(att32.shape), np.empty(att32.shape)
    # the reference backward starts from the kernel's float32 att, so only the backward's own error is measured
    attention_backward_ref(rdinp, rdpreatt, rdatt, dout.astype(np.float64), inp.astype(np.float64),
                           att32.astype(np.float64), NH)
    for name, g, w in zip(("dinp", "dpreatt", "datt"), (dinp, dpreatt, datt), (rdinp, rdpreatt, rdatt)):
        err[name] = rel_err(kdev.to_host(g), w)
    print(f"attention B={B} T={T} C={C} NH={NH}: relative error vs float64 {err}; worst {max(err.values()):.2e}")
    # float32 storage of every intermediate; dot products of 64 terms and row sums of up to 1024 in float64
    assert max(err.values()) < 1e-5


# ---- the gemm path: head-major products + row softmax (the simulator runs it on the tiled product) --------
def _forward_fast(fdev, inp, NH):
    B, T, C3 = inp.shape
    C = C3 // 3
    out, preatt, att = poisoned(fdev, (B, T, C)), poisoned(fdev, (B, NH, T, T)), poisoned(fdev, (B, NH, T, T))
    qkvr = poisoned(fdev, (3, B, NH, T, C // NH))
    attention_forward(fdev, out, preatt, att, fdev.asarray(inp, np.float32), NH, qkvr)
    return out, preatt, att, qkvr


def test_attention_gemm_path_forward_and_backward_match_reference(fdev, rng):
    inp = rng.normal(size=(B, T, 3 * C))
    dout = rng.normal(size=(B, T, C))
    out, preatt, att, qkvr = _forward_fast(fdev, inp, NH)
    want = _forward_ref(inp, NH)
    lower = np.tril(np.ones((T, T), dtype=bool))
    # float32 inputs, products of 4 terms, float32 exp: a few ulps (TF32 on a GPU: ~1e-3)
    tol = 5e-3 if fdev.matmul == "cublas" else 1e-6
    assert rel_err(fdev.to_host(out), want[0]) < tol
    assert rel_err(fdev.to_host(att), want[2]) < tol
    # preatt is defined on and below the diagonal; att is exactly 0 above it
    assert rel_err(fdev.to_host(preatt)[..., lower], want[1][..., lower]) < tol
    assert np.all(fdev.to_host(att)[..., ~lower] == 0)
    # backward from the same att; dinp accumulates, dpreatt and datt are scratch
    dinp0 = rng.normal(size=inp.shape)
    dinp = fdev.asarray(dinp0, np.float32)
    dpreatt, datt = poisoned(fdev, want[2].shape), poisoned(fdev, want[2].shape)
    attention_backward(fdev, dinp, dpreatt, datt, fdev.asarray(dout, np.float32), fdev.asarray(inp, np.float32),
                       att, NH, qkvr)
    rdinp = dinp0.copy()
    attention_backward_ref(rdinp, np.empty(want[2].shape), np.empty(want[2].shape), dout, inp,
                           fdev.to_host(att).astype(np.float64), NH)
    assert rel_err(fdev.to_host(dinp), rdinp) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tf32", "fp32"])
def test_attention_gemm_path_matches_float64_reference_at_gpt2_size(fdev, fdev_exact, rng, which):
    dev = fdev if which == "tf32" else fdev_exact
    B, T, C, NH = 4, 1024, 768, 12
    inp = rng.normal(size=(B, T, 3 * C)).astype(np.float32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    out, preatt, att, qkvr = _forward_fast(dev, inp, NH)
    want = _forward_ref(inp.astype(np.float64), NH)
    err = {"out": rel_err(dev.to_host(out), want[0]), "att": rel_err(dev.to_host(att), want[2])}
    del want, preatt
    att32 = dev.to_host(att)
    dinp = dev.zeros(inp.shape)
    dpreatt, datt = poisoned(dev, att32.shape), poisoned(dev, att32.shape)
    attention_backward(dev, dinp, dpreatt, datt, dev.asarray(dout), dev.asarray(inp), att, NH, qkvr)
    rdinp = np.zeros(inp.shape)
    attention_backward_ref(rdinp, np.empty(att32.shape), np.empty(att32.shape), dout.astype(np.float64),
                           inp.astype(np.float64), att32.astype(np.float64), NH)
    err["dinp"] = rel_err(dev.to_host(dinp), rdinp)
    print(f"attention gemm path ({which}) B={B} T={T} C={C} NH={NH}: relative error vs float64 {err}")
    # fp32: as the direct kernels; TF32: 10-bit mantissas in the products, ~1e-3
    assert max(err.values()) < (1e-5 if which == "fp32" else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [37, 300, 1030])
def test_softmax_rows_warp_kernels_match_reference_and_repeat_bit_for_bit(fdev, rng, T):
    # T=37: rows shorter than a warp, rows spanning two passes of the lanes (odd T: the scalar warp kernels);
    # T=300: the paired kernels with the row in registers, some lanes' slots partly filled; T=1030: past the
    # registers (T > 1024), the paired loop kernels, rows spanning several 128-word chunks, the last one
    # partial; R*T rows, not a multiple of 8
    from llmz.kernels.attention import softmax_rows, softmax_rows_backward
    R = 3
    pre = rng.normal(size=(R, T, T)) * 3
    datt = rng.normal(size=(R, T, T))
    lower = np.tril(np.ones((T, T), dtype=bool))
    masked = np.where(lower, pre, -np.inf)
    want = np.exp(masked - masked.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    runs = []
    for _ in range(2):
        att, dpre = poisoned(fdev, (R, T, T)), poisoned(fdev, (R, T, T))
        softmax_rows(fdev, att, fdev.asarray(pre, np.float32))
        softmax_rows_backward(fdev, dpre, fdev.asarray(datt, np.float32), att)
        runs.append((fdev.to_host(att), fdev.to_host(dpre)))
    a32 = runs[0][0].astype(np.float64)
    want_d = a32 * (datt - (a32 * datt * lower).sum(-1, keepdims=True)) * lower
    # float32 exp and sums of at most 300 terms: a few ulps
    assert rel_err(runs[0][0], want) < 1e-6 and rel_err(runs[0][1], want_d) < 1e-6
    # exactly +0.0 above the diagonal (no -0.0: the bits are zero)
    assert np.all(runs[0][0][:, ~lower].view(np.uint32) == 0) and np.all(runs[0][1][:, ~lower].view(np.uint32) == 0)
    assert all(np.array_equal(x, y) for x, y in zip(runs[0], runs[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 300, 1030])
def test_softmax_rows_pairs_kernels_leave_a_zero_upper_triangle_unwritten(fdev, rng, T):
    # upper_is_zero: the caller's buffer already holds +0.0 above the diagonal. The paired kernels (even T)
    # then write on and below it only: the same bits there as a full write, and a sentinel above it stays
    from llmz.kernels.attention import softmax_rows, softmax_rows_backward
    R = 3
    pre = fdev.asarray(rng.normal(size=(R, T, T)) * 3, np.float32)
    datt = fdev.asarray(rng.normal(size=(R, T, T)), np.float32)
    lower = np.tril(np.ones((T, T), dtype=bool))
    full_att, full_dpre = poisoned(fdev, (R, T, T)), poisoned(fdev, (R, T, T))
    softmax_rows(fdev, full_att, pre)
    softmax_rows_backward(fdev, full_dpre, datt, full_att)
    sentinel = np.where(lower, np.nan, 7.0).astype(np.float32)
    att, dpre = fdev.asarray(np.broadcast_to(sentinel, (R, T, T))), fdev.asarray(np.broadcast_to(sentinel, (R, T, T)))
    softmax_rows(fdev, att, pre, upper_is_zero=True)
    softmax_rows_backward(fdev, dpre, datt, full_att, upper_is_zero=True)
    # the word holding the diagonal is written whole: for even t its second element, t+1, gets its +0.0
    t, t2 = np.indices((T, T))
    in_diagonal_word = (t2 == t + 1) & (t % 2 == 0)
    for got, want in ((att, full_att), (dpre, full_dpre)):
        got, want = fdev.to_host(got), fdev.to_host(want)
        # on and below the diagonal (and the rest of its word): the full write's bits; above: the sentinel
        written = lower | in_diagonal_word
        assert np.array_equal(got[:, written], want[:, written])
        assert np.all(got[:, ~written] == 7.0)
    print(f"softmax rows pairs, T={T}: upper triangle left unwritten, lower bit-identical to the full write")
