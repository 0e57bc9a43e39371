"""Matmul (llmz/kernels/matmul.py, the teaching kernels on the tiled product): against the NumPy reference,
the reference against finite differences, bf16 storage. Sizes are not multiples of TILE=16, so every tile
loop meets a ragged edge. The fast path (cuBLAS, the bias fill, the column sums): tests/test_fast_matmul.py."""
import numpy as np
import pytest

from helpers import NAN_BF16, finite_diff, poisoned, rand_bf16, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.grid import ceil_div
from llmz.kernels.matmul import (
    matmul_backward,
    matmul_backward_bias_kernel,
    matmul_backward_ref,
    matmul_forward,
    matmul_forward_bias_kernel,
    matmul_forward_ref,
)

B, T, C, OC = 2, 3, 20, 18


def _inputs(rng, B, T, C, OC):
    """float64 host inputs: inp (B,T,C), weight (OC,C), bias (OC,), dout (B,T,OC)."""
    return (rng.normal(size=(B, T, C)), rng.normal(size=(OC, C)) * 0.5, rng.normal(size=(OC,)),
            rng.normal(size=(B, T, OC)))


@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_forward_kernel_matches_reference(kdev, rng, with_bias):
    inp, weight, bias, _ = _inputs(rng, B, T, C, OC)
    bias = bias if with_bias else None
    out = poisoned(kdev, (B, T, OC))
    matmul_forward(kdev, out, kdev.asarray(inp, np.float32), kdev.asarray(weight, np.float32),
                   None if bias is None else kdev.asarray(bias, np.float32))
    ref = np.empty((B, T, OC))
    matmul_forward_ref(ref, inp, weight, bias)
    # float32 inputs rounded once, products summed over C=20: a few ulps
    assert rel_err(kdev.to_host(out), ref) < 1e-6


def test_matmul_forward_kernel_is_exact_in_float64(kdev, rng):
    inp, weight, bias, _ = _inputs(rng, B, T, C, OC)
    out = poisoned(kdev, (B, T, OC), np.float64)
    matmul_forward(kdev, out, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = np.empty((B, T, OC))
    matmul_forward_ref(ref, inp, weight, bias)
    # the same sums in float64, only in another order
    assert rel_err(kdev.to_host(out), ref) < 1e-14


def test_matmul_backward_kernel_overwrites_dinp_when_asked(kdev, rng):
    inp, weight, _, dout = _inputs(rng, B, T, C, OC)
    dweight0, dbias0 = rng.normal(size=weight.shape), rng.normal(size=OC)
    # dinp starts as NaN: a kernel that read it (accumulated) would leave NaN
    dinp = poisoned(kdev, inp.shape)
    dweight, dbias = kdev.asarray(dweight0, np.float32), kdev.asarray(dbias0, np.float32)
    matmul_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout, np.float32), kdev.asarray(inp, np.float32),
                    kdev.asarray(weight, np.float32), dinp_accumulate=False)
    ref_dinp, ref_dw, ref_db = np.full(inp.shape, np.nan), dweight0.copy(), dbias0.copy()
    matmul_backward_ref(ref_dinp, ref_dw, ref_db, dout, inp, weight, dinp_accumulate=False)
    # float32 products over OC=18 or N=6 terms: a few ulps, as the accumulating test
    for got, want in ((dinp, ref_dinp), (dweight, ref_dw), (dbias, ref_db)):
        assert rel_err(kdev.to_host(got), want) < 1e-6


@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul_backward_kernel_matches_reference_and_accumulates(kdev, rng, with_bias):
    inp, weight, _, dout = _inputs(rng, B, T, C, OC)
    # backward accumulates: every gradient starts from random non-zero values
    dinp0, dweight0, dbias0 = rng.normal(size=inp.shape), rng.normal(size=weight.shape), rng.normal(size=OC)
    dinp, dweight = kdev.asarray(dinp0, np.float32), kdev.asarray(dweight0, np.float32)
    dbias = kdev.asarray(dbias0, np.float32) if with_bias else None
    matmul_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout, np.float32), kdev.asarray(inp, np.float32),
                    kdev.asarray(weight, np.float32))
    rdinp, rdweight, rdbias = dinp0.copy(), dweight0.copy(), dbias0.copy() if with_bias else None
    matmul_backward_ref(rdinp, rdweight, rdbias, dout, inp, weight)
    # float32 rounding of inputs and of the accumulated result, sums of at most 18 terms: a few ulps
    assert rel_err(kdev.to_host(dinp), rdinp) < 1e-6
    assert rel_err(kdev.to_host(dweight), rdweight) < 1e-6
    if with_bias:
        assert rel_err(kdev.to_host(dbias), rdbias) < 1e-6


# one thread per element of out: N = 1 and 9 rows, OC = 37 past the 32-thread block
@pytest.mark.parametrize("N", [1, 9])
def test_matmul_forward_bias_kernel_writes_the_bias_into_every_row(kdev, rng, N):
    OC = 37
    bias = rng.normal(size=OC).astype(np.float32)
    out = poisoned(kdev, (N, OC))
    kdev.launch(matmul_forward_bias_kernel, ceil_div(N * OC, kdev.block_size), kdev.block_size, out,
                kdev.asarray(bias))
    # a copy: bit-exact (a missed element keeps its NaN)
    np.testing.assert_array_equal(kdev.to_host(out), np.broadcast_to(bias, (N, OC)))


def test_matmul_reference_backward_matches_finite_differences(rng):
    inp, weight, bias, dout = _inputs(rng, 2, 3, 5, 4)
    dinp, dweight, dbias = np.zeros_like(inp), np.zeros_like(weight), np.zeros_like(bias)
    matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight)

    def forward(inp, weight, bias):
        out = np.empty(dout.shape)
        matmul_forward_ref(out, inp, weight, bias)
        return out
    for x, grad, f in [(inp, dinp, lambda x: forward(x, weight, bias)),
                       (weight, dweight, lambda x: forward(inp, x, bias)),
                       (bias, dbias, lambda x: forward(inp, weight, x))]:
        idx, g = finite_diff(f, x, dout)
        assert rel_err(grad.reshape(-1)[idx], g) < 1e-6


# ---- bf16 storage ------------------------------------------------------------------------------------
def test_matmul_forward_on_bf16_is_close_to_the_bf16_reference(kdev, rng):
    N, C_, OC = 6, 20, 18
    inp, weight, bias = rand_bf16(rng, (N, C_)), rand_bf16(rng, (OC, C_), 0.5), rand_bf16(rng, OC)
    out = kdev.asarray(np.full((N, OC), NAN_BF16, np.uint16))
    matmul_forward(kdev, out, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = np.full((N, OC), NAN_BF16, np.uint16)
    matmul_forward_ref(ref, inp, weight, bias)
    # the kernels and the reference both round product + bias once, the products summed in another order:
    # within one bf16 step, 2^-7 relative at the bottom of a binade, 1e-2 absolute where the bias cancels
    np.testing.assert_allclose(bf16_to_f32(kdev.to_host(out)), bf16_to_f32(ref), rtol=2 ** -7, atol=1e-2)


def test_matmul_forward_bias_kernel_on_bf16_copies_the_bias_bits(kdev, rng):
    N, OC = 3, 37
    bias = rand_bf16(rng, OC)
    out = kdev.asarray(np.full((N, OC), NAN_BF16, np.uint16))
    kdev.launch(matmul_forward_bias_kernel, ceil_div(N * OC, kdev.block_size), kdev.block_size, out,
                kdev.asarray(bias))
    np.testing.assert_array_equal(kdev.to_host(out), np.broadcast_to(bias, (N, OC)))
    # a bf16 bias into a float32 out: its values exactly
    out32 = kdev.full((N, OC), np.nan, np.float32)
    kdev.launch(matmul_forward_bias_kernel, ceil_div(N * OC, kdev.block_size), kdev.block_size, out32,
                kdev.asarray(bias))
    np.testing.assert_array_equal(kdev.to_host(out32), np.broadcast_to(bf16_to_f32(bias), (N, OC)))


def test_matmul_backward_bias_kernel_on_bf16_rounds_the_float64_sum_once(kdev, rng):
    dout, start = rand_bf16(rng, (37, 45)), rand_bf16(rng, 45)          # C past the 32-thread block
    dbias = kdev.asarray(start)
    kdev.launch(matmul_backward_bias_kernel, ceil_div(45, kdev.block_size), kdev.block_size, dbias,
                kdev.asarray(dout))
    want = bf16_to_f32(start).astype(np.float64) + bf16_to_f32(dout).sum(axis=0, dtype=np.float64)
    # float64 sum, the start added in float64, rounded to float32 then to bf16 (the kernel's store_add)
    np.testing.assert_array_equal(kdev.to_host(dbias), f32_to_bf16(want.astype(np.float32)))


# ---- real GPU, GPT-2 124M sizes -------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,OC", [(4, 1024, 768, 768), (4, 1024, 768, 3 * 768), (4, 1024, 768, 50304)])
def test_matmul_kernels_match_float64_reference_at_gpt2_size(kdev, rng, B, T, C, OC):
    inp, weight, bias, dout = (x.astype(np.float32) for x in _inputs(rng, B, T, C, OC))
    out = poisoned(kdev, (B, T, OC))
    matmul_forward(kdev, out, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = np.empty((B, T, OC))
    matmul_forward_ref(ref, *(x.astype(np.float64) for x in (inp, weight, bias)))
    err = {"out": rel_err(kdev.to_host(out), ref)}
    del out, ref
    dinp, dweight, dbias = kdev.zeros(inp.shape), kdev.zeros(weight.shape), kdev.zeros(bias.shape)
    matmul_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout), kdev.asarray(inp), kdev.asarray(weight))
    r = [np.zeros(x.shape) for x in (inp, weight, bias)]
    matmul_backward_ref(*r, *(x.astype(np.float64) for x in (dout, inp, weight)))
    for name, got, want in zip(("dinp", "dweight", "dbias"), (dinp, dweight, dbias), r):
        err[name] = rel_err(kdev.to_host(got), want)
    print(f"matmul B={B} T={T} C={C} OC={OC}: relative error vs float64 {err}; worst {max(err.values()):.2e}")
    # float32 inputs; each product rounded to float32 and summed over up to B*T=4096 terms in float64
    assert max(err.values()) < 1e-5
