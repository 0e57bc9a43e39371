"""Attention's fast path (llmz/fast/attention.py) against the reference and the teaching kernels
(llmz/kernels/attention.py): the warp softmax on words of two elements in the simulator too (llmz.device
emulates the warp shuffle), leaving a zero upper triangle unwritten where asked; on a GPU the cuBLAS products
over per-head addresses, at small and GPT-2 sizes, full fp32 and TF32."""
import numpy as np
import pytest
from test_attention import GB, GNH, GT, _forward_ref, causal, poison, worst_rel

from helpers import REL_BF16, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.fast import attention as fast
from llmz.fast.attention import (
    ROWS_PER_BLOCK,
    softmax_rows,
    softmax_rows_backward,
    softmax_rows_pairs_kernel,
    softmax_rows_pairs_regs_kernel,
)
from llmz.fast.device_helpers import pair_view
from llmz.kernels import attention as teaching
from llmz.kernels.attention import attention_backward_ref
from llmz.kernels.grid import ceil_div

B, T, C, NH = 2, 5, 12, 3          # head size 4


def softmax_want(pre, datt, att):
    """float64 causal softmax of pre's rows, and the softmax backward of datt given att (R,T,T)."""
    T = pre.shape[-1]
    lower = np.tril(np.ones((T, T), dtype=bool))
    masked = np.where(lower, pre, -np.inf)
    want = np.exp(masked - masked.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    a = att.astype(np.float64)
    return want, a * (datt - (a * datt * lower).sum(-1, keepdims=True)) * lower


# (2, 6): even T, the row in registers (forward) and the loop kernel (backward); (2, 5): odd T, the teaching
# kernels; R*T rows not a multiple of the 8 warps of a block
@pytest.mark.parametrize("R, T_", [(2, 6), (2, 5)])
def test_softmax_rows_match_float64_and_the_teaching_kernels(fdev, kdev, rng, launched, R, T_):
    pre, datt = rng.normal(size=(R, T_, T_)) * 3, rng.normal(size=(R, T_, T_))
    names = launched(fdev)
    att, dpre = poisoned(fdev, (R, T_, T_)), poisoned(fdev, (R, T_, T_))
    softmax_rows(fdev, att, fdev.asarray(pre, np.float32))
    softmax_rows_backward(fdev, dpre, fdev.asarray(datt, np.float32), att)
    paired = T_ % 2 == 0
    assert names == (["softmax_rows_pairs_regs_kernel", "softmax_rows_backward_pairs_kernel"] if paired else
                     ["attention_softmax_kernel", "attention_softmax_backward_kernel"])
    want, want_d = softmax_want(pre, datt, fdev.to_host(att))
    # float32 exp and sums of at most 6 terms: a few ulps; exactly +0.0 above the diagonal
    assert rel_err(fdev.to_host(att), want) < 1e-6 and rel_err(fdev.to_host(dpre), want_d) < 1e-6
    upper = np.triu(np.ones((T_, T_), dtype=bool), k=1)
    assert np.all(fdev.to_host(att)[:, upper].view(np.uint32) == 0)
    assert np.all(fdev.to_host(dpre)[:, upper].view(np.uint32) == 0)
    # the teaching kernels on the same rows: the same values up to float32 rounding
    t_att, t_pre = poisoned(kdev, (1, R, T_, T_)), kdev.asarray(pre.reshape(1, R, T_, T_), np.float32)
    kdev.launch(teaching.attention_softmax_kernel, ceil_div(R * T_, kdev.block_size), kdev.block_size, t_att, t_pre)
    assert rel_err(fdev.to_host(att), kdev.to_host(t_att)[0]) < 1e-6


def test_softmax_rows_loop_kernel_matches_the_register_kernel(fdev, rng):
    # the loop kernel runs past 1024 columns on a GPU; here both on T = 8 (one chunk of the loop)
    R, T_ = 1, 8
    pre = fdev.asarray(rng.normal(size=(R, T_, T_)) * 3, np.float32)
    runs = []
    for kernel in (softmax_rows_pairs_kernel, softmax_rows_pairs_regs_kernel):
        att = poisoned(fdev, (R, T_, T_))
        fdev.launch(kernel, ceil_div(R * T_, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK, pair_view(att), pair_view(pre),
                    True)
        runs.append(fdev.to_host(att))
    want, _ = softmax_want(fdev.to_host(pre).astype(np.float64), np.zeros((R, T_, T_)), runs[0])
    for got in runs:
        assert rel_err(got, want) < 1e-6


def test_softmax_rows_pairs_kernels_leave_a_zero_upper_triangle_unwritten(fdev, rng):
    # upper_is_zero: the caller's buffer already holds +0.0 above the diagonal; the paired kernels then write
    # on and below it only (and the rest of the diagonal's word): the same bits there as a full write
    R, T_ = 1, 6
    pre = fdev.asarray(rng.normal(size=(R, T_, T_)) * 3, np.float32)
    datt = fdev.asarray(rng.normal(size=(R, T_, T_)), np.float32)
    full_att, full_dpre = poisoned(fdev, (R, T_, T_)), poisoned(fdev, (R, T_, T_))
    softmax_rows(fdev, full_att, pre)
    softmax_rows_backward(fdev, full_dpre, datt, full_att)
    lower = np.tril(np.ones((T_, T_), dtype=bool))
    sentinel = np.where(lower, np.nan, 7.0).astype(np.float32)
    att = fdev.asarray(np.broadcast_to(sentinel, (R, T_, T_)))
    dpre = fdev.asarray(np.broadcast_to(sentinel, (R, T_, T_)))
    softmax_rows(fdev, att, pre, upper_is_zero=True)
    softmax_rows_backward(fdev, dpre, datt, full_att, upper_is_zero=True)
    t, t2 = np.indices((T_, T_))
    written = lower | ((t2 == t + 1) & (t % 2 == 0))
    for got, want in ((att, full_att), (dpre, full_dpre)):
        got, want = fdev.to_host(got), fdev.to_host(want)
        assert np.array_equal(got[:, written], want[:, written])
        assert np.all(got[:, ~written] == 7.0)


def test_attention_fast_layer_without_cublas_is_the_teaching_kernels(fdev, rng, launched):
    if fdev.attention == "gemm":
        pytest.skip("the simulator's fast set (no cuBLAS): direct attention")
    names = launched(fdev)
    inp = rng.normal(size=(B, T, 3 * C))
    out, preatt, att = poisoned(fdev, (B, T, C)), poisoned(fdev, (B, NH, T, T)), poisoned(fdev, (B, NH, T, T))
    fast.attention_forward(fdev, out, preatt, att, fdev.asarray(inp, np.float32), NH, upper_is_zero=True)
    assert names == ["attention_scores_kernel", "attention_softmax_kernel", "attention_values_kernel"]
    assert rel_err(fdev.to_host(out), _forward_ref(inp, NH)[0]) < 1e-6


# ---- on the GPU: the cuBLAS path ----------------------------------------------------------------------------
def _forward_fast(dev, inp, NH):
    B, T, C3 = inp.shape
    out, preatt, att = poisoned(dev, (B, T, C3 // 3)), poisoned(dev, (B, NH, T, T)), poisoned(dev, (B, NH, T, T))
    fast.attention_forward(dev, out, preatt, att, dev.asarray(inp, np.float32), NH)
    return out, preatt, att


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tf32", "fp32"])
def test_attention_gemm_path_forward_and_backward_match_reference(fdev, fdev_exact, rng, which):
    dev = fdev if which == "tf32" else fdev_exact
    inp, dout = rng.normal(size=(B, T, 3 * C)), rng.normal(size=(B, T, C))
    out, preatt, att = _forward_fast(dev, inp, NH)
    want = _forward_ref(inp, NH)
    lower = np.tril(np.ones((T, T), dtype=bool))
    # float32 inputs, products of 4 terms, float32 exp: a few ulps (TF32: ~1e-3)
    tol = 5e-3 if which == "tf32" else 1e-6
    assert rel_err(dev.to_host(out), want[0]) < tol and rel_err(dev.to_host(att), want[2]) < tol
    # preatt is defined on and below the diagonal; att is exactly 0 above it (odd T: the teaching softmax)
    assert rel_err(dev.to_host(preatt)[..., lower], want[1][..., lower]) < tol
    assert np.all(dev.to_host(att)[..., ~lower] == 0)
    for accumulate in (True, False):
        dinp0 = rng.normal(size=inp.shape) if accumulate else np.full(inp.shape, np.nan)
        dinp = dev.asarray(dinp0, np.float32)
        dpreatt, datt = poisoned(dev, want[2].shape), poisoned(dev, want[2].shape)
        fast.attention_backward(dev, dinp, dpreatt, datt, dev.asarray(dout, np.float32),
                                dev.asarray(inp, np.float32), att, NH, accumulate=accumulate)
        rdinp = dinp0.copy()
        attention_backward_ref(rdinp, np.empty(want[2].shape), np.empty(want[2].shape), dout, inp,
                               dev.to_host(att).astype(np.float64), NH, accumulate=accumulate)
        assert rel_err(dev.to_host(dinp), rdinp) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tf32", "fp32"])
def test_attention_gemm_path_matches_float64_reference_at_gpt2_size(fdev, fdev_exact, rng, which):
    dev = fdev if which == "tf32" else fdev_exact
    B, T, C, NH = 4, 1024, 768, 12
    inp = rng.normal(size=(B, T, 3 * C)).astype(np.float32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    out, preatt, att = _forward_fast(dev, inp, NH)
    want = _forward_ref(inp.astype(np.float64), NH)
    err = {"out": rel_err(dev.to_host(out), want[0]), "att": rel_err(dev.to_host(att), want[2])}
    del want, preatt
    att32 = dev.to_host(att)
    dinp = dev.zeros(inp.shape)
    dpreatt, datt = poisoned(dev, att32.shape), poisoned(dev, att32.shape)
    fast.attention_backward(dev, dinp, dpreatt, datt, dev.asarray(dout), dev.asarray(inp), att, NH)
    rdinp = np.zeros(inp.shape)
    attention_backward_ref(rdinp, np.empty(att32.shape), np.empty(att32.shape), dout.astype(np.float64),
                           inp.astype(np.float64), att32.astype(np.float64), NH)
    err["dinp"] = rel_err(dev.to_host(dinp), rdinp)
    print(f"attention gemm path ({which}) B={B} T={T} C={C} NH={NH}: relative error vs float64 {err}")
    # fp32: as the direct kernels; TF32: 10-bit mantissas in the products, ~1e-3
    assert max(err.values()) < (1e-5 if which == "fp32" else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [37, 300, 1030])
def test_softmax_rows_match_reference_and_repeat_bit_for_bit_on_gpu(fdev, rng, T):
    # T=37: odd, the teaching kernels;
    # T=300: the paired kernels with the row in registers, some lanes' slots partly filled; T=1030: past the
    # registers (T > 1024), the paired loop kernels, rows spanning several 128-word chunks, the last one
    # partial; R*T rows, not a multiple of 8
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
def test_softmax_rows_pairs_kernels_leave_a_zero_upper_triangle_unwritten_on_gpu(fdev, rng, T):
    # upper_is_zero: the caller's buffer already holds +0.0 above the diagonal. The paired kernels (even T)
    # then write on and below it only: the same bits there as a full write, and a sentinel above it stays
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


@pytest.mark.gpu
def test_paired_softmax_kernels_on_bf16_are_the_float32_kernels_rounded_at_gpt2_size(fdev, rng):
    # the layer functions on a GPU take the paired kernels for even T (bf16 rows as uint32 words, float32
    # rows as uint64 words): the bf16 run equals the float32 run rounded, and the upper triangle is +0
    shape = (GB * GNH, GT, GT)
    pre, datt = causal(rng, shape, 2.0), causal(rng, shape)
    # bf16
    att16, dpre16 = fdev.asarray(poison(shape)), fdev.asarray(poison(shape))
    softmax_rows(fdev, att16, fdev.asarray(pre))
    softmax_rows_backward(fdev, dpre16, fdev.asarray(datt), att16)
    # float32 on the same inputs widened; its backward from the bf16 run's att, so only rounding differs
    att32, dpre32 = fdev.asarray(np.full(shape, np.nan, np.float32)), fdev.asarray(np.full(shape, np.nan, np.float32))
    softmax_rows(fdev, att32, fdev.asarray(bf16_to_f32(pre)))
    softmax_rows_backward(fdev, dpre32, fdev.asarray(bf16_to_f32(datt)), fdev.asarray(bf16_to_f32(fdev.to_host(att16))))
    upper = np.triu(np.ones((GT, GT), dtype=bool), k=1)
    for name, got, want in (("softmax rows (pairs)", fdev.to_host(att16), fdev.to_host(att32)),
                            ("softmax rows backward (pairs)", fdev.to_host(dpre16), fdev.to_host(dpre32))):
        err = worst_rel(got, want)
        print(f"{name}: worst relative error per element {err:.3e} (bound {REL_BF16:.3e}); "
              f"{np.mean(got == f32_to_bf16(want)):.4%} bit-identical to round_to_nearest(float32 kernel)")
        assert err <= REL_BF16
        assert np.all(got[:, upper] == 0) and np.all(want[:, upper].view(np.uint32) == 0)


@pytest.mark.gpu
def test_attention_fast_layers_match_the_teaching_kernels_at_gpt2_size(kdev, fdev_exact, rng):
    B, T, C, NH = 4, 1024, 768, 12
    inp = rng.normal(size=(B, T, 3 * C)).astype(np.float32)
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    got = {}
    for name, dev, k in (("teaching", kdev, teaching), ("fast", fdev_exact, fast)):
        out, preatt, att = poisoned(dev, (B, T, C)), dev.zeros((B, NH, T, T)), dev.zeros((B, NH, T, T))
        k.attention_forward(dev, out, preatt, att, dev.asarray(inp), NH, upper_is_zero=True)
        dinp, dpreatt, datt = poisoned(dev, inp.shape), dev.zeros((B, NH, T, T)), dev.zeros((B, NH, T, T))
        k.attention_backward(dev, dinp, dpreatt, datt, dev.asarray(dout), dev.asarray(inp), att, NH,
                             accumulate=False, upper_is_zero=True)
        got[name] = [dev.to_host(a) for a in (out, att, dinp)]
        del preatt, att, dpreatt, datt
    errs = {what: rel_err(f, t) for what, t, f in zip(("out", "att", "dinp"), got["teaching"], got["fast"])}
    print(f"attention B={B} T={T} C={C} NH={NH}: fast (fp32 cuBLAS) vs teaching, relative difference {errs}")
    # both within 1e-5 of float64 (the tests above)
    assert max(errs.values()) < 2e-5
