"""bf16 storage (uint16 bits) in attention, the matmul bias, the tiled product, the gradient norm and fill, in
the simulator: each converted kernel run on uint16 arrays against the same kernel on float32 copies of their
values (the float32 kernel on the widened inputs), its outputs rounded to nearest bf16.

The uint16 specialisation does the float32 kernel's arithmetic and rounds at the store, so the two agree bit
for bit; the one exception is the direct teaching softmax, which stores the unnormalised exponentials in att
and scales them in place: in bf16 that is two roundings (within 2^-7 of the float32 result, not one step).
The layer functions are checked against their NumPy references' bf16 path (llmz.bf16.run_in_f32)."""
import math

import numpy as np
import pytest
from test_bf16_storage import NAN_BF16, REL_BF16, assert_within_one_step, rand_bf16

from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.device import ceil_div
from llmz.kernels.attention import (
    ROWS_PER_BLOCK,
    attention_backward,
    attention_backward_ref,
    attention_dinp_kernel,
    attention_forward,
    attention_forward_ref,
    attention_scores_kernel,
    attention_softmax_backward_kernel,
    attention_softmax_kernel,
    attention_values_kernel,
    heads_merge_kernel,
    heads_split_kernel,
    softmax_rows_backward_kernel,
    softmax_rows_backward_warp_kernel,
    softmax_rows_kernel,
    softmax_rows_warp_kernel,
)
from llmz.kernels.fill import fill, fill_ref, zero
from llmz.kernels.gemm import gemm_ref, gemm_tiled
from llmz.kernels.matmul import bias_grid, matmul_bias_fill_kernel, matmul_forward, matmul_forward_ref
from llmz.kernels.norm import MAX_BLOCK, NORM_BLOCKS, norm_squared, norm_squared_ref

B, T, NH, HS = 1, 5, 2, 4            # C = 8: one block of 32 threads covers most launches; T=5 is ragged
C = NH * HS
# the direct softmax rounds twice in bf16 (the stored exponential, then the normalised value)
REL_TWO_ROUNDINGS = 2 * REL_BF16 + REL_BF16 ** 2


# ---- helpers ------------------------------------------------------------------------------------------
def poison(shape):
    return np.full(shape, NAN_BF16, np.uint16)


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
    inp, dout = rand_bf16(rng, (B, T, 3 * C)), rand_bf16(rng, (B, T, C))
    n = B * NH * T * T
    # forward: preatt from q and k; backward: datt from dout and v
    check(kdev, attention_scores_kernel, ceil_div(n, kdev.block_size), kdev.block_size,
          [poison((B, NH, T, T)), inp, 0, inp, C, HS, 1.0 / math.sqrt(HS)], [0])
    check(kdev, attention_scores_kernel, ceil_div(n, kdev.block_size), kdev.block_size,
          [poison((B, NH, T, T)), dout, 0, inp, 2 * C, HS, 1.0], [0])


def test_attention_softmax_kernel_on_bf16_is_within_two_roundings_of_float32(kdev, rng):
    preatt = causal(rng, (B, NH, T, T), 2.0)
    check(kdev, attention_softmax_kernel, ceil_div(B * NH * T, kdev.block_size), kdev.block_size,
          [poison((B, NH, T, T)), preatt], [0], rel=REL_TWO_ROUNDINGS, name="direct softmax")


def test_attention_values_and_softmax_backward_kernels_on_bf16_are_the_float32_kernels_rounded(kdev, rng):
    att, datt, inp = causal(rng, (B, NH, T, T)), causal(rng, (B, NH, T, T)), rand_bf16(rng, (B, T, 3 * C))
    bs = kdev.block_size
    check(kdev, attention_values_kernel, ceil_div(B * T * C, bs), bs, [poison((B, T, C)), att, inp], [0])
    check(kdev, attention_softmax_backward_kernel, ceil_div(B * NH * T, bs), bs,
          [poison((B, NH, T, T)), datt, att], [0])


def test_attention_dinp_kernel_on_bf16_accumulates_the_float32_kernel_rounded(kdev, rng):
    dpreatt, att = causal(rng, (B, NH, T, T)), causal(rng, (B, NH, T, T))
    dout, inp = rand_bf16(rng, (B, T, C)), rand_bf16(rng, (B, T, 3 * C))
    dinp0 = rand_bf16(rng, (B, T, 3 * C))                                # accumulates: starts random
    check(kdev, attention_dinp_kernel, ceil_div(B * T * C, kdev.block_size), kdev.block_size,
          [dinp0, dpreatt, att, dout, inp, 1.0 / math.sqrt(HS)], [0])


def test_attention_layer_on_bf16_is_close_to_the_bf16_reference(kdev, rng):
    inp, dout, dinp0 = rand_bf16(rng, (B, T, 3 * C)), rand_bf16(rng, (B, T, C)), rand_bf16(rng, (B, T, 3 * C))
    out, preatt, att = (kdev.asarray(poison(s)) for s in ((B, T, C), (B, NH, T, T), (B, NH, T, T)))
    attention_forward(kdev, out, preatt, att, kdev.asarray(inp), NH)
    dinp, dpre, datt = kdev.asarray(dinp0), kdev.asarray(poison((B, NH, T, T))), kdev.asarray(poison((B, NH, T, T)))
    attention_backward(kdev, dinp, dpre, datt, kdev.asarray(dout), kdev.asarray(inp), att, NH)
    r_out, r_pre, r_att = poison((B, T, C)), poison((B, NH, T, T)), poison((B, NH, T, T))
    attention_forward_ref(r_out, r_pre, r_att, inp, NH)
    r_dinp, r_dpre, r_datt = dinp0.copy(), poison((B, NH, T, T)), poison((B, NH, T, T))
    attention_backward_ref(r_dinp, r_dpre, r_datt, dout, inp, r_att, NH)
    # the kernels round every intermediate (preatt, att twice, datt, dpreatt) to bf16, the reference only its
    # outputs: a few bf16 steps (2^-8 relative each) carried through exp and sums of 5 terms of size ~1
    for got, want in ((out, r_out), (preatt, r_pre), (att, r_att), (dinp, r_dinp), (dpre, r_dpre), (datt, r_datt)):
        g = bf16_to_f32(kdev.to_host(got))
        assert not np.any(np.isnan(g))
        np.testing.assert_allclose(g, bf16_to_f32(want), rtol=2 ** -5, atol=2 ** -5)


# ---- the gemm path's kernels: head-major copies, the block softmax ------------------------------------
def test_heads_split_and_merge_kernels_copy_bf16_bits_and_accumulate_rounded(kdev, rng):
    bs = kdev.block_size
    x = rand_bf16(rng, (B * T, 3 * C))
    grid = (B * T, ceil_div(3 * C, bs))
    # a copy: the bits themselves
    (y,), _ = run_both(kdev, heads_split_kernel, grid, bs, [poison((3, B, NH, T, HS)), x], [0])
    np.testing.assert_array_equal(y, x.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4))
    (x2,), _ = run_both(kdev, heads_merge_kernel, grid, bs, [poison((B * T, 3 * C)), y, False], [0])
    np.testing.assert_array_equal(x2, x)
    # accumulate: one float32 add, rounded; and bf16 heads into a float32 x (mixed storage)
    check(kdev, heads_merge_kernel, grid, bs, [rand_bf16(rng, (B * T, 3 * C)), y, True], [0])
    x32 = rng.normal(size=(B * T, 3 * C)).astype(np.float32)
    check(kdev, heads_merge_kernel, grid, bs, [x32, y, True], [0])


def test_softmax_rows_block_kernels_on_bf16_are_the_float32_kernels_rounded(kdev, rng):
    R = B * NH
    pre, att, datt = causal(rng, (R, T, T), 2.0), causal(rng, (R, T, T)), causal(rng, (R, T, T))
    bs = min(kdev.block_size, MAX_BLOCK)
    check(kdev, softmax_rows_kernel, R * T, bs, [poison((R, T, T)), pre], [0])
    check(kdev, softmax_rows_backward_kernel, R * T, bs, [poison((R, T, T)), datt, att], [0])


# ---- matmul bias, the tiled product ----------------------------------------------------------------------
@pytest.mark.parametrize("N", [3, 40])
def test_matmul_bias_fill_kernel_on_bf16_is_the_float32_kernel_rounded(kdev, rng, N):
    # OC = 37: past the 32-thread block; N = 3: fewer rows than one thread's 32, N = 40: 2 row blocks, the
    # last thread's second row past the end. A copy: bf16 in, the same bits out
    OC = 37
    grid = bias_grid(kdev, N, OC)
    check(kdev, matmul_bias_fill_kernel, grid, kdev.block_size, [poison((N, OC)), rand_bf16(rng, OC)], [0])
    # a bf16 bias into a float32 out: its values exactly (a missed element keeps its NaN)
    bias = rand_bf16(rng, OC)
    out = kdev.asarray(np.full((N, OC), np.nan, np.float32))
    kdev.launch(matmul_bias_fill_kernel, grid, kdev.block_size, out, kdev.asarray(bias))
    np.testing.assert_array_equal(kdev.to_host(out), np.broadcast_to(bf16_to_f32(bias), (N, OC)))


@pytest.mark.parametrize("trans_a,trans_b,accumulate", [(False, False, False), (True, False, True),
                                                        (False, True, True), (True, True, False)])
def test_gemm_tiled_kernel_on_bf16_is_the_float32_kernel_rounded(kdev, rng, trans_a, trans_b, accumulate):
    M, N, K = 17, 5, 19                                  # past the tile edges
    a = rand_bf16(rng, (K, M) if trans_a else (M, K))
    b = rand_bf16(rng, (N, K) if trans_b else (K, N))
    c0 = rand_bf16(rng, (M, N)) if accumulate else poison((M, N))
    c, c32 = kdev.asarray(c0), kdev.asarray(bf16_to_f32(c0))
    gemm_tiled(kdev, c, kdev.asarray(a), kdev.asarray(b), trans_a, trans_b, accumulate, alpha=0.5)
    gemm_tiled(kdev, c32, kdev.asarray(bf16_to_f32(a)), kdev.asarray(bf16_to_f32(b)), trans_a, trans_b,
               accumulate, alpha=0.5)
    got = kdev.to_host(c)
    assert_rounded_bits(got, kdev.to_host(c32))
    # the reference's bf16 path: the same products, summed in another order (float32 in NumPy): one step
    ref = c0.copy()
    gemm_ref(ref, a, b, trans_a, trans_b, accumulate, alpha=0.5)
    assert_within_one_step(got, ref, atol=1e-5)


def test_gemm_tiled_kernel_mixes_bf16_and_float32_operands(kdev, rng):
    M, N, K = 17, 5, 19
    a, b = rand_bf16(rng, (M, K)), rng.normal(size=(K, N)).astype(np.float32)
    c = kdev.asarray(np.full((M, N), np.nan, np.float32))
    c32 = kdev.asarray(np.full((M, N), np.nan, np.float32))
    gemm_tiled(kdev, c, kdev.asarray(a), kdev.asarray(b), False, False, False)
    gemm_tiled(kdev, c32, kdev.asarray(bf16_to_f32(a)), kdev.asarray(b), False, False, False)
    # a bf16 tile is staged as float32, exactly: the float32 result itself
    np.testing.assert_array_equal(kdev.to_host(c), kdev.to_host(c32))


def test_matmul_forward_on_bf16_is_close_to_the_bf16_reference(kdev, rng):
    N, C_, OC = 6, 20, 18
    inp, weight, bias = rand_bf16(rng, (N, C_)), rand_bf16(rng, (OC, C_), 0.5), rand_bf16(rng, OC)
    out = kdev.asarray(poison((N, OC)))
    matmul_forward(kdev, out, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = poison((N, OC))
    matmul_forward_ref(ref, inp, weight, bias)
    # the kernels and the reference both round product + bias once, the products summed in another order:
    # within one bf16 step, 2^-7 relative at the bottom of a binade, 1e-2 absolute where the bias cancels
    np.testing.assert_allclose(bf16_to_f32(kdev.to_host(out)), bf16_to_f32(ref), rtol=2 ** -7, atol=1e-2)


# ---- gradient norm, fill ----------------------------------------------------------------------------------
def test_norm_squared_of_bf16_gradients_equals_the_float32_sum_bit_for_bit(kdev, rng):
    x = rand_bf16(rng, 300)
    scratch = kdev.asarray(np.zeros(NORM_BLOCKS))
    out, out32 = kdev.asarray(np.full(1, np.nan)), kdev.asarray(np.full(1, np.nan))
    norm_squared(kdev, out, kdev.asarray(x), scratch)
    norm_squared(kdev, out32, kdev.asarray(bf16_to_f32(x)), scratch)
    # exact float32 values summed in float64 in the same order: the same bits
    np.testing.assert_array_equal(kdev.to_host(out), kdev.to_host(out32))
    ref = np.full(1, np.nan)
    norm_squared_ref(ref, x, None)
    # float64 sums of 300 terms of size ~1, another order
    np.testing.assert_allclose(kdev.to_host(out), ref, rtol=1e-13)
    assert ref[0] == pytest.approx(float(np.sum(bf16_to_f32(x).astype(np.float64) ** 2)), rel=1e-13)


@pytest.mark.parametrize("value", [0.1, -3.0, 0.0, 1e-30])
def test_fill_kernel_on_bf16_stores_the_rounded_bits_of_value(kdev, value):
    x = kdev.asarray(poison(37))
    fill(kdev, x, value)
    ref = poison(37)
    fill_ref(ref, value)
    want = f32_to_bf16(np.float32(value))
    assert np.all(kdev.to_host(x) == want) and np.all(ref == want)


def test_zero_on_bf16_is_all_zero_bits(kdev):
    x = kdev.asarray(poison(40))
    zero(kdev, x)
    assert np.all(kdev.to_host(x) == 0)


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


@pytest.mark.gpu
def test_gemm_path_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    R, hs, bs = GB * GNH, GC // GNH, kdev.block_size
    x = rand_bf16(rng, (GB * GT, 3 * GC))
    grid = (GB * GT, ceil_div(3 * GC, bs))
    check(kdev, heads_split_kernel, grid, bs, [poison((3, GB, GNH, GT, hs)), x], [0], rel=0.0, name="heads split")
    y = rand_bf16(rng, (3, GB, GNH, GT, hs))
    check(kdev, heads_merge_kernel, grid, bs, [rand_bf16(rng, (GB * GT, 3 * GC)), y, True], [0],
          rel=REL_BF16, name="heads merge (accumulate)")
    pre, att, datt = causal(rng, (R, GT, GT), 2.0), causal(rng, (R, GT, GT), 0.05), causal(rng, (R, GT, GT))
    warp = ceil_div(R * GT, ROWS_PER_BLOCK), 32 * ROWS_PER_BLOCK
    for name, kernel, grid_, block, args in (
            ("softmax rows (block)", softmax_rows_kernel, R * GT, min(bs, MAX_BLOCK), [poison(pre.shape), pre]),
            ("softmax rows (warp)", softmax_rows_warp_kernel, *warp, [poison(pre.shape), pre]),
            ("softmax rows backward (block)", softmax_rows_backward_kernel, R * GT, min(bs, MAX_BLOCK),
             [poison(att.shape), datt, att]),
            ("softmax rows backward (warp)", softmax_rows_backward_warp_kernel, *warp,
             [poison(att.shape), datt, att])):
        check(kdev, kernel, grid_, block, args, [0], rel=REL_BF16, name=name)


@pytest.mark.gpu
def test_paired_softmax_kernels_on_bf16_are_the_float32_kernels_rounded_at_gpt2_size(kdev, rng):
    # the layer functions on a GPU take the paired kernels for even T (bf16 rows as uint32 words, float32
    # rows as uint64 words): the bf16 run equals the float32 run rounded, and the upper triangle is +0
    from llmz.kernels.attention import softmax_rows, softmax_rows_backward
    shape = (GB * GNH, GT, GT)
    pre, datt = causal(rng, shape, 2.0), causal(rng, shape)
    # bf16
    att16, dpre16 = kdev.asarray(poison(shape)), kdev.asarray(poison(shape))
    softmax_rows(kdev, att16, kdev.asarray(pre))
    softmax_rows_backward(kdev, dpre16, kdev.asarray(datt), att16)
    # float32 on the same inputs widened; its backward from the bf16 run's att, so only rounding differs
    att32, dpre32 = kdev.asarray(np.full(shape, np.nan, np.float32)), kdev.asarray(np.full(shape, np.nan, np.float32))
    softmax_rows(kdev, att32, kdev.asarray(bf16_to_f32(pre)))
    softmax_rows_backward(kdev, dpre32, kdev.asarray(bf16_to_f32(datt)), kdev.asarray(bf16_to_f32(kdev.to_host(att16))))
    upper = np.triu(np.ones((GT, GT), dtype=bool), k=1)
    for name, got, want in (("softmax rows (pairs)", kdev.to_host(att16), kdev.to_host(att32)),
                            ("softmax rows backward (pairs)", kdev.to_host(dpre16), kdev.to_host(dpre32))):
        err = worst_rel(got, want)
        print(f"{name}: worst relative error per element {err:.3e} (bound {REL_BF16:.3e}); "
              f"{np.mean(got == f32_to_bf16(want)):.4%} bit-identical to round_to_nearest(float32 kernel)")
        assert err <= REL_BF16
        assert np.all(got[:, upper] == 0) and np.all(want[:, upper].view(np.uint32) == 0)


@pytest.mark.gpu
def test_matmul_bias_and_tiled_gemm_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    N, OC = 16384, 2304
    check(kdev, matmul_bias_fill_kernel, bias_grid(kdev, N, OC), kdev.block_size,
          [poison((N, OC)), rand_bf16(rng, OC)], [0], rel=REL_BF16, name="matmul bias fill")
    M, K = GB * GT, GC                                   # the attention projection: (4096, 768) @ (768, 768).T
    a, b, c0 = rand_bf16(rng, (M, K)), rand_bf16(rng, (GC, K)), rand_bf16(rng, (M, GC))
    c, c32 = kdev.asarray(c0), kdev.asarray(bf16_to_f32(c0))
    gemm_tiled(kdev, c, kdev.asarray(a), kdev.asarray(b), False, True, True)
    gemm_tiled(kdev, c32, kdev.asarray(bf16_to_f32(a)), kdev.asarray(bf16_to_f32(b)), False, True, True)
    got, want = kdev.to_host(c), kdev.to_host(c32)
    print(f"gemm tiled: worst relative error {worst_rel(got, want):.3e} (bound {REL_BF16:.3e}); "
          f"{np.mean(got == f32_to_bf16(want)):.4%} bit-identical to round_to_nearest(float32 kernel)")
    assert worst_rel(got, want) <= REL_BF16


@pytest.mark.gpu
def test_norm_of_bf16_gradients_equals_the_float32_norm_at_gpt2_size(kdev, rng):
    n = 124_475_904                                      # GPT-2 124M's parameter count
    x = rand_bf16(rng, n, 1e-3)
    scratch = kdev.asarray(np.zeros(NORM_BLOCKS))
    out, out32 = kdev.asarray(np.full(1, np.nan)), kdev.asarray(np.full(1, np.nan))
    norm_squared(kdev, out, kdev.asarray(x), scratch)
    norm_squared(kdev, out32, kdev.asarray(bf16_to_f32(x)), scratch)
    got, want = kdev.to_host(out)[0], kdev.to_host(out32)[0]
    print(f"norm^2 of 124M bf16 values: {got!r}, float32 kernel {want!r}, relative difference "
          f"{abs(got - want) / want:.3e} (bound 0: the same float64 sum of the same exact values)")
    assert got == want
