"""LayerNorm's fast kernels (llmz/fast/layernorm.py: kernels built per width C on 16-byte units; the backward
one pass over the rows with per-team dweight/dbias partial sums, then a column sum; the residual add fused into
the forward) against the NumPy reference and the teaching kernels (llmz/kernels/layernorm.py). In the
simulator too (llmz.device emulates the warp shuffle); widths not a multiple of 8 and float64 take the
teaching kernels."""
import sys

import numpy as np
import pytest
from test_layernorm import forward64, layernorm_bf16_against_float32, ln_inputs, make_inputs, widen

import llmz.fast
from helpers import nan_storage, poisoned, rel_err
from llmz.bf16 import f32_to_bf16
from llmz.fast import layernorm as fast
from llmz.fast.layernorm import TEAM_ROWS, backward_teams, residual_layernorm_forward, team_warps
from llmz.kernels import layernorm as teaching
from llmz.kernels import residual as teaching_residual
from llmz.kernels.layernorm import layernorm_backward_ref


@pytest.fixture(autouse=True)
def quick_barriers():
    """The simulator's block manager busy-polls for every syncthreads: switching Python threads every 50 us
    instead of every 5 ms makes the kernels' barriers (and the emulated shuffle's) several times faster."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(interval)


# (5,16): two units a row, fewer than a warp's lanes; (7,40): odd rows (a warp with no row), 5 units;
# (3,264): 33 units, a lane with a second unit (forward) and a team thread with a second unit (backward)
SHAPES = [(5, 16), (7, 40), (3, 264)]


def forward_backward(dev, k, shape, inp, weight, bias, dout, starts):
    """k's layernorm_forward into NaN-poisoned outputs, then its backward from random non-zero gradients."""
    x, w, b, dy = (dev.asarray(a) for a in (inp, weight, bias, dout))
    out, mean, rstd = poisoned(dev, shape), poisoned(dev, shape[:1]), poisoned(dev, shape[:1])
    k.layernorm_forward(dev, out, mean, rstd, x, w, b)
    grads = [dev.asarray(a) for a in starts]
    k.layernorm_backward(dev, *grads, dy, x, w, mean, rstd)
    return [dev.to_host(a) for a in (out, mean, rstd, *grads)]


@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_fast_layers_match_float64_reference_and_accumulate(fdev, rng, launched, shape):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    dout = rng.normal(size=shape).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, shape[1], shape[1])]
    names = launched(fdev)
    out, mean, rstd, *grads = forward_backward(fdev, fast, shape, inp, weight, bias, dout, starts)
    assert names == ["layernorm_forward_units_kernel", "layernorm_backward_units_kernel",
                     "column_sum_units_kernel"]
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    want = [a.astype(np.float64) for a in starts]
    layernorm_backward_ref(*want, dout.astype(np.float64), inp.astype(np.float64), weight.astype(np.float64),
                           mean.astype(np.float64), rstd.astype(np.float64))
    # float32 sums per lane / thread and float64 across them, float32 inputs and stores; dweight, dbias float32
    # over each team's rows, then float64: a few ulps, 1e-6 normwise leaves a wide margin
    for name, got, r in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"), (out, mean, rstd, *grads),
                            (*ref, *want)):
        assert rel_err(got, r) < 1e-6, name


def test_layernorm_fast_layers_match_the_teaching_layers(kdev, fdev, rng):
    shape = (9, 80)
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    dout = rng.normal(size=shape).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, shape[1], shape[1])]
    got_t = forward_backward(kdev, teaching, shape, inp, weight, bias, dout, starts)
    got_f = forward_backward(fdev, fast, shape, inp, weight, bias, dout, starts)
    # not the same bits (the sums group differently): both within a few float32 ulps of float64, so of each other
    for what, t, f in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"), got_t, got_f):
        assert rel_err(f, t) < 2e-6, what


# C = 45 (not a multiple of 8) and float64 arrays: the teaching kernels, right all the same
@pytest.mark.parametrize("C, dtype", [(45, np.float32), (16, np.float64)])
def test_layernorm_takes_the_teaching_kernels_where_units_do_not_fit(fdev, rng, launched, C, dtype):
    shape = (5, C)
    inp, weight, bias = (a.astype(dtype) for a in make_inputs(rng, shape))
    dout = rng.normal(size=shape).astype(dtype)
    starts = [rng.normal(size=s).astype(dtype) for s in (shape, C, C)]
    names = launched(fdev)
    x, w, b, dy = (fdev.asarray(a) for a in (inp, weight, bias, dout))
    out, mean, rstd = poisoned(fdev, shape, dtype), poisoned(fdev, 5, dtype), poisoned(fdev, 5, dtype)
    fast.layernorm_forward(fdev, out, mean, rstd, x, w, b)
    grads = [fdev.asarray(a) for a in starts]
    fast.layernorm_backward(fdev, *grads, dy, x, w, mean, rstd)
    assert names == ["layernorm_forward_kernel", "layernorm_backward_inp_kernel", "layernorm_backward_params_kernel"]
    ref = forward64(inp.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64))
    assert rel_err(fdev.to_host(out), ref[0]) < (1e-13 if dtype == np.float64 else 1e-6)


# the fused residual forward: residual the residual kernel's bits, out, mean, rstd the layernorm kernel's bits
# on that residual (float32 and bf16 storage)
@pytest.mark.parametrize("shape", [(7, 40), (3, 264)])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_residual_layernorm_forward_is_the_residual_then_the_layernorm_bit_for_bit(fdev, rng, shape, bf16):
    conv = (lambda a: f32_to_bf16(a.astype(np.float32))) if bf16 else (lambda a: a.astype(np.float32))
    inp1, inp2 = conv(rng.normal(size=shape)), conv(rng.normal(size=shape))
    weight, bias = conv(rng.normal(size=shape[1])), conv(rng.normal(size=shape[1]))
    a, b2, w, b = (fdev.asarray(v) for v in (inp1, inp2, weight, bias))
    dtype = np.uint16 if bf16 else np.float32
    storage = "bf16" if bf16 else "float32"
    fused = [nan_storage(fdev, shape, storage), nan_storage(fdev, shape, storage),
             poisoned(fdev, shape[0], np.float32), poisoned(fdev, shape[0], np.float32)]
    residual_layernorm_forward(fdev, *fused, a, b2, w, b)
    apart = [fdev.zeros(shape, dtype), fdev.zeros(shape, dtype), fdev.zeros(shape[0], np.float32),
             fdev.zeros(shape[0], np.float32)]
    teaching_residual.residual_forward(fdev, apart[0], a, b2)
    fast.layernorm_forward(fdev, apart[1], apart[2], apart[3], apart[0], w, b)
    for name, f, t in zip(("residual", "out", "mean", "rstd"), fused, apart):
        np.testing.assert_array_equal(fdev.to_host(f), fdev.to_host(t), err_msg=name)


def test_backward_teams_bound_the_rows_a_team_adds_in_float32():
    for N, C in ((16384, 768), (8192, 1024), (8192, 1280), (8192, 1600), (4096, 768), (5, 16), (1, 8)):
        G = backward_teams(N, C)
        assert 1 <= G <= N and -(-N // G) <= TEAM_ROWS
        assert team_warps(C) * 32 * 2 * 8 >= C                   # a team holds a whole row (2 units a thread)


# d12's rows and channels at B=16; d24, d36, d48's channels at B=8: each width's kernels
GPT2_SHAPES = [(16384, 768), (8192, 1024), (8192, 1280), (8192, 1600)]


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", GPT2_SHAPES)
def test_layernorm_fast_kernels_match_float64_reference_and_repeat_bits_at_gpt2_size(fdev, rng, N, C):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (N, C)))
    dout = rng.normal(size=(N, C)).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in ((N, C), C, C)]
    runs = [forward_backward(fdev, fast, (N, C), inp, weight, bias, dout, starts) for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    out, mean, rstd, *grads = runs[0]
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    want = [a.astype(np.float64) for a in starts]
    layernorm_backward_ref(*want, *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    errs = {name: rel_err(g, r) for name, g, r in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"),
                                                      (out, mean, rstd, *grads), (*ref, *want))}
    print(f"layernorm fast N={N} C={C}: relative error against float64 {errs}")
    assert max(errs.values()) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", GPT2_SHAPES)
def test_layernorm_fast_bf16_kernels_match_float32_kernels_at_gpt2_size(fdev, rng, N, C):
    layernorm_bf16_against_float32(fdev, llmz.fast, rng, N, C)


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(8192, 1600)])
def test_residual_layernorm_forward_on_bf16_at_d48_size(fdev, rng, N, C):
    inp1, inp2 = (f32_to_bf16(rng.normal(size=(N, C)).astype(np.float32)) for _ in range(2))
    _, weight, bias = ln_inputs(rng, (N, C))
    a, b2, w, b = (fdev.asarray(v) for v in (inp1, inp2, weight, bias))
    res, out = fdev.zeros((N, C), np.uint16), fdev.zeros((N, C), np.uint16)
    mean, rstd = fdev.zeros(N, np.float32), fdev.zeros(N, np.float32)
    residual_layernorm_forward(fdev, res, out, mean, rstd, a, b2, w, b)
    want_res = f32_to_bf16((widen(inp1) + widen(inp2)).astype(np.float32))
    np.testing.assert_array_equal(fdev.to_host(res), want_res)
    ref = forward64(widen(want_res).astype(np.float64), widen(weight).astype(np.float64),
                    widen(bias).astype(np.float64))
    assert rel_err(widen(fdev.to_host(out)), ref[0]) < 1e-2           # bf16 outputs: the rounding
    assert rel_err(fdev.to_host(mean), ref[1]) < 1e-6 and rel_err(fdev.to_host(rstd), ref[2]) < 1e-6
