"""Attention (llmz/kernels/attention.py, the teaching kernels: one per line of the math): against the NumPy
reference, the reference against finite differences, causality, bf16 storage. The fast path (cuBLAS products,
the warp softmax): tests/test_fast_attention.py."""
import math

import numpy as np
import pytest

from helpers import NAN_BF16, REL_BF16, finite_diff, poisoned, rand_bf16, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.attention import (
    attention_backward,
    attention_backward_ref,
    attention_dinp_kernel,
    attention_forward,
    attention_forward_ref,
    attention_scores_kernel,
    attention_softmax_backward_kernel,
    attention_softmax_kernel,
    attention_values_kernel,
)
from llmz.kernels.grid import ceil_div

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


def test_attention_backward_overwrites_dinp_when_asked(kdev, rng):
    inp = rng.normal(size=(B, T, 3 * C))
    dout = rng.normal(size=(B, T, C))
    att = _forward_ref(inp, NH)[2]
    # dinp starts as NaN: a kernel that read it (accumulated) would leave NaN
    dinp = poisoned(kdev, inp.shape)
    dpreatt, datt = poisoned(kdev, att.shape), poisoned(kdev, att.shape)
    attention_backward(kdev, dinp, dpreatt, datt, kdev.asarray(dout, np.float32), kdev.asarray(inp, np.float32),
                       kdev.asarray(att, np.float32), NH, accumulate=False)
    rdinp = np.full(inp.shape, np.nan)
    attention_backward_ref(rdinp, np.empty(att.shape), np.empty(att.shape), dout, inp, att, NH, accumulate=False)
    # as the accumulating test: a few ulps
    assert rel_err(kdev.to_host(dinp), rdinp) < 1e-6


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


# ---- bf16 storage --------------------------------------------------------------------------------
# the direct softmax rounds twice in bf16 (the stored exponential, then the normalised value)
REL_TWO_ROUNDINGS = 2 * REL_BF16 + REL_BF16 ** 2


# ---- helpers ------------------------------------------------------------------------------------------
def poison(shape):
    return np.full(shape, NAN_BF16, np.uint16)


SB, ST, SNH, SHS = 1, 5, 2, 4        # bf16 sizes: C = 8, one block of 32 threads covers most launches; T=5 ragged
SC = SNH * SHS


def run_both(dev, kernel, grid, block, args, outs):
    """Launch `kernel` on args as given (host arrays go to the device; uint16 = bf16 bits) and on float32
    copies of every uint16 array. Returns the outputs at positions `outs`: (bf16 run, float32 run), on the host."""
    def dev_args(widen):
        return [dev.asarray(bf16_to_f32(a) if widen and a.dtype == np.uint16 else a)
                if isinstance(a, np.ndarray) else a for a in args]
    d16, d32 = dev_args(False), dev_args(True)
    dev.launch(kernel, grid, block, *d16)
    dev.launch(kernel, grid, block, *d32)
    return [dev.to_host(d16[k]) for k in outs], [dev.to_host(d32[k]) for k in outs]


def assert_rounded_bits(got_bits, want32):
    """got: uint16 from the bf16 run; want32: float32 from the float32 run. Bit for bit round_to_nearest."""
    assert not np.any(np.isnan(bf16_to_f32(got_bits))), "NaN in the output: an element was not written"
    assert not np.any(np.isnan(want32))
    np.testing.assert_array_equal(got_bits, f32_to_bf16(want32))


def worst_rel(got_bits, want32):
    got, want = bf16_to_f32(got_bits).astype(np.float64), want32.astype(np.float64)
    return float((np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)).max())


def check(dev, kernel, grid, block, args, outs, rel=None, name=""):
    """Every output of the bf16 run is the float32 run rounded to bf16: bit for bit (rel None), or within
    rel of it per element (printing the worst)."""
    got, want = run_both(dev, kernel, grid, block, args, outs)
    for g, w in zip(got, want):
        if g.dtype != np.uint16:            # a float output from bf16 inputs: the same float32 arithmetic
            np.testing.assert_array_equal(g, w)
        elif rel is None:
            assert_rounded_bits(g, w)
        else:
            err = worst_rel(g, w)
            print(f"{name}: worst relative error per element {err:.3e} (bound {rel:.3e})")
            assert not np.any(np.isnan(bf16_to_f32(g))) and err <= rel


def causal(rng, shape, scale=1.0):
    """Random bf16 (R..,T,T) rows, zero above the diagonal (as preatt, att, datt are)."""
    x = bf16_to_f32(rand_bf16(rng, shape, scale))
    x[..., np.triu(np.ones(shape[-2:], dtype=bool), k=1)] = 0
    return f32_to_bf16(x)


# ---- direct attention kernels: one kernel at a time, on the bf16 run's own inputs ----------------------
def test_attention_scores_kernel_on_bf16_is_the_float32_kernel_rounded(kdev, rng):
    inp, dout = rand_bf16(rng, (SB, ST, 3 * SC)), rand_bf16(rng, (SB, ST, SC))
    n = SB * SNH * ST * ST
    # forward: preatt from q and k; backward: datt from dout and v
    check(kdev, attention_scores_kernel, ceil_div(n, kdev.block_size), kdev.block_size,
          [poison((SB, SNH, ST, ST)), inp, 0, inp, SC, SHS, 1.0 / math.sqrt(SHS)], [0])
    check(kdev, attention_scores_kernel, ceil_div(n, kdev.block_size), kdev.block_size,
          [poison((SB, SNH, ST, ST)), dout, 0, inp, 2 * SC, SHS, 1.0], [0])


def test_attention_softmax_kernel_on_bf16_is_within_two_roundings_of_float32(kdev, rng):
    preatt = causal(rng, (SB, SNH, ST, ST), 2.0)
    check(kdev, attention_softmax_kernel, ceil_div(SB * SNH * ST, kdev.block_size), kdev.block_size,
          [poison((SB, SNH, ST, ST)), preatt], [0], rel=REL_TWO_ROUNDINGS, name="direct softmax")


def test_attention_values_and_softmax_backward_kernels_on_bf16_are_the_float32_kernels_rounded(kdev, rng):
    att, datt, inp = causal(rng, (SB, SNH, ST, ST)), causal(rng, (SB, SNH, ST, ST)), rand_bf16(rng, (SB, ST, 3 * SC))
    bs = kdev.block_size
    check(kdev, attention_values_kernel, ceil_div(SB * ST * SC, bs), bs, [poison((SB, ST, SC)), att, inp], [0])
    check(kdev, attention_softmax_backward_kernel, ceil_div(SB * SNH * ST, bs), bs,
          [poison((SB, SNH, ST, ST)), datt, att], [0])


def test_attention_dinp_kernel_on_bf16_accumulates_the_float32_kernel_rounded(kdev, rng):
    dpreatt, att = causal(rng, (SB, SNH, ST, ST)), causal(rng, (SB, SNH, ST, ST))
    dout, inp = rand_bf16(rng, (SB, ST, SC)), rand_bf16(rng, (SB, ST, 3 * SC))
    dinp0 = rand_bf16(rng, (SB, ST, 3 * SC))                                # accumulates: starts random
    check(kdev, attention_dinp_kernel, ceil_div(SB * ST * SC, kdev.block_size), kdev.block_size,
          [dinp0, dpreatt, att, dout, inp, 1.0 / math.sqrt(SHS)], [0])


def test_attention_layer_on_bf16_is_close_to_the_bf16_reference(kdev, rng):
    inp, dout, dinp0 = rand_bf16(rng, (SB, ST, 3 * SC)), rand_bf16(rng, (SB, ST, SC)), rand_bf16(rng, (SB, ST, 3 * SC))
    out, preatt, att = (kdev.asarray(poison(s)) for s in ((SB, ST, SC), (SB, SNH, ST, ST), (SB, SNH, ST, ST)))
    attention_forward(kdev, out, preatt, att, kdev.asarray(inp), SNH)
    dinp, dpre, datt = kdev.asarray(dinp0), kdev.asarray(poison((SB, SNH, ST, ST))), kdev.asarray(poison((SB, SNH, ST, ST)))
    attention_backward(kdev, dinp, dpre, datt, kdev.asarray(dout), kdev.asarray(inp), att, SNH)
    r_out, r_pre, r_att = poison((SB, ST, SC)), poison((SB, SNH, ST, ST)), poison((SB, SNH, ST, ST))
    attention_forward_ref(r_out, r_pre, r_att, inp, SNH)
    r_dinp, r_dpre, r_datt = dinp0.copy(), poison((SB, SNH, ST, ST)), poison((SB, SNH, ST, ST))
    attention_backward_ref(r_dinp, r_dpre, r_datt, dout, inp, r_att, SNH)
    # the kernels round every intermediate (preatt, att twice, datt, dpreatt) to bf16, the reference only its
    # outputs: a few bf16 steps (2^-8 relative each) carried through exp and sums of 5 terms of size ~1
    for got, want in ((out, r_out), (preatt, r_pre), (att, r_att), (dinp, r_dinp), (dpre, r_dpre), (datt, r_datt)):
        g = bf16_to_f32(kdev.to_host(got))
        assert not np.any(np.isnan(g))
        np.testing.assert_allclose(g, bf16_to_f32(want), rtol=2 ** -5, atol=2 ** -5)


# ---- on the GPU at GPT-2 size: each bf16 kernel against the float32 kernel on the same (widened) inputs ----
GB, GT, GC, GNH = 4, 1024, 768, 12


@pytest.mark.gpu
def test_direct_attention_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    hs, bs = GC // GNH, kdev.block_size
    sq = (GB, GNH, GT, GT)
    inp, dout = rand_bf16(rng, (GB, GT, 3 * GC)), rand_bf16(rng, (GB, GT, GC))
    n = GB * GNH * GT * GT
    check(kdev, attention_scores_kernel, ceil_div(n, bs), bs,
          [poison(sq), inp, 0, inp, GC, hs, 1.0 / math.sqrt(hs)], [0], rel=REL_BF16, name="scores (preatt)")
    check(kdev, attention_scores_kernel, ceil_div(n, bs), bs,
          [poison(sq), dout, 0, inp, 2 * GC, hs, 1.0], [0], rel=REL_BF16, name="scores (datt)")
    pre, att, datt = causal(rng, sq, 2.0), causal(rng, sq, 0.05), causal(rng, sq)
    check(kdev, attention_softmax_kernel, ceil_div(GB * GNH * GT, bs), bs, [poison(sq), pre], [0],
          rel=REL_TWO_ROUNDINGS, name="direct softmax (two roundings)")
    check(kdev, attention_values_kernel, ceil_div(GB * GT * GC, bs), bs, [poison((GB, GT, GC)), att, inp], [0],
          rel=REL_BF16, name="values")
    check(kdev, attention_softmax_backward_kernel, ceil_div(GB * GNH * GT, bs), bs, [poison(sq), datt, att], [0],
          rel=REL_BF16, name="softmax backward")
    check(kdev, attention_dinp_kernel, ceil_div(GB * GT * GC, bs), bs,
          [rand_bf16(rng, (GB, GT, 3 * GC)), datt, att, dout, inp, 1.0 / math.sqrt(hs)], [0],
          rel=REL_BF16, name="dinp (accumulate)")


