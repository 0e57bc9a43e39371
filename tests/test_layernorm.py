"""LayerNorm: the kernels against the NumPy reference, the reference against finite differences. The fast
warp-per-row kernels (GPU only in the layer) run in the simulator too, with an emulated warp shuffle."""
import sys
import threading
import time

import numpy as np
import pytest

from helpers import finite_diff, gpu_ms_per_call, poisoned, rel_err
from llmz.device import ceil_div
from llmz.kernels.layernorm import (
    WARP,
    layernorm_backward,
    layernorm_backward_inp_warp_kernel,
    layernorm_backward_ref,
    layernorm_forward,
    layernorm_forward_ref,
    layernorm_forward_warp_kernel,
    warp_rows_geometry,
)


def make_inputs(rng, shape):
    """inp with a non-zero mean and non-unit spread per row; weight around 1, bias around 0."""
    C = shape[-1]
    inp = rng.normal(size=shape) * rng.uniform(0.5, 3.0, size=shape[:-1] + (1,)) + rng.normal(size=shape[:-1] + (1,))
    return inp, 1.0 + 0.3 * rng.normal(size=C), 0.3 * rng.normal(size=C)


def forward64(inp, weight, bias):
    """The float64 reference forward: (out, mean, rstd)."""
    out = np.empty_like(inp)
    mean = np.empty(inp.shape[:-1])
    rstd = np.empty(inp.shape[:-1])
    layernorm_forward_ref(out, mean, rstd, inp, weight, bias)
    return out, mean, rstd


# (2,3,20): C below the simulator's 32-thread block; (5,45): 2-D rows, C not a multiple of the block
@pytest.mark.parametrize("shape", [(2, 3, 20), (5, 45)])
def test_layernorm_forward_kernel_matches_reference(kdev, rng, shape):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    out = poisoned(kdev, shape)
    mean = poisoned(kdev, shape[:-1])
    rstd = poisoned(kdev, shape[:-1])
    layernorm_forward(kdev, out, mean, rstd, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = forward64(inp.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64))
    # the kernel sums in float64; what is left is the float32 rounding of inputs' products and of the stores
    for got, want in zip((out, mean, rstd), ref):
        assert rel_err(kdev.to_host(got), want) < 1e-6


# (17,45) also: dweight, dbias in three row chunks (8 rows each in the simulator), the last one partial
@pytest.mark.parametrize("shape", [(2, 3, 20), (5, 45), (17, 45)])
def test_layernorm_backward_kernel_matches_reference_and_accumulates(kdev, rng, shape):
    C = shape[-1]
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=shape)
    # backward accumulates: start every gradient from random non-zero values
    dinp0, dweight0, dbias0 = rng.normal(size=shape), rng.normal(size=C), rng.normal(size=C)
    # both sides see the same float32-representable inputs
    inp, weight, mean, rstd, dout = (a.astype(np.float32) for a in (inp, weight, mean, rstd, dout))
    dinp = kdev.asarray(dinp0, np.float32)
    dweight = kdev.asarray(dweight0, np.float32)
    dbias = kdev.asarray(dbias0, np.float32)
    layernorm_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout), kdev.asarray(inp), kdev.asarray(weight),
                       kdev.asarray(mean), kdev.asarray(rstd))
    ref = [dinp0.copy(), dweight0.copy(), dbias0.copy()]
    layernorm_backward_ref(*ref, *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # float64 sums in the kernel; float32 products (weight*dout, norm) and stores: a few ulps per element
    for got, want in zip((dinp, dweight, dbias), ref):
        assert rel_err(kdev.to_host(got), want) < 1e-6


def test_layernorm_backward_kernel_gives_the_same_bits_twice(kdev, rng):
    shape = (17, 45)
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    args = [kdev.asarray(a, np.float32) for a in (rng.normal(size=shape), inp, weight, mean, rstd)]
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, 45, 45)]
    got = []
    for _ in range(2):
        grads = [kdev.asarray(a) for a in starts]
        layernorm_backward(kdev, *grads, *args)
        got.append([kdev.to_host(g) for g in grads])
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_layernorm_reference_backward_matches_finite_differences(rng):
    shape = (2, 3, 20)
    inp, weight, bias = make_inputs(rng, shape)
    dout = rng.normal(size=shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dinp, dweight, dbias = np.zeros(shape), np.zeros(20), np.zeros(20)
    layernorm_backward_ref(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    # out as a function of each input in turn (mean and rstd are recomputed, so they carry gradient too)
    checks = [(inp, dinp, lambda x: forward64(x, weight, bias)[0]),
              (weight, dweight, lambda w: forward64(inp, w, bias)[0]),
              (bias, dbias, lambda b: forward64(inp, weight, b)[0])]
    for x, grad, f in checks:
        idx, g = finite_diff(f, x, dout)
        assert rel_err(grad.reshape(-1)[idx], g) <= 1e-6


def test_layernorm_reference_accepts_2d_rows_like_3d(rng):
    inp, weight, bias = make_inputs(rng, (2, 3, 20))
    out3, mean3, rstd3 = forward64(inp, weight, bias)
    out2, mean2, rstd2 = forward64(inp.reshape(6, 20), weight, bias)
    np.testing.assert_array_equal(out2, out3.reshape(6, 20))
    np.testing.assert_array_equal(mean2, mean3.reshape(6))
    np.testing.assert_array_equal(rstd2, rstd3.reshape(6))


@pytest.mark.gpu
def test_layernorm_kernels_match_float64_reference_at_gpt2_size(kdev, rng):
    B, T, C = 16, 1024, 768
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (B, T, C)))
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    out, mean, rstd = poisoned(kdev, (B, T, C)), poisoned(kdev, (B, T)), poisoned(kdev, (B, T))
    layernorm_forward(kdev, out, mean, rstd, kdev.asarray(inp), kdev.asarray(weight), kdev.asarray(bias))
    ref = forward64(inp.astype(np.float64), weight.astype(np.float64), bias.astype(np.float64))
    errs = {name: rel_err(kdev.to_host(a), r) for name, a, r in zip(("out", "mean", "rstd"), (out, mean, rstd), ref)}
    # backward from zero gradients, on the kernel's own float32 mean and rstd
    mean_h, rstd_h = kdev.to_host(mean), kdev.to_host(rstd)
    dinp, dweight, dbias = kdev.zeros((B, T, C)), kdev.zeros(C), kdev.zeros(C)
    layernorm_backward(kdev, dinp, dweight, dbias, kdev.asarray(dout), kdev.asarray(inp), kdev.asarray(weight),
                       mean, rstd)
    want = [np.zeros((B, T, C)), np.zeros(C), np.zeros(C)]
    layernorm_backward_ref(*want, *(a.astype(np.float64) for a in (dout, inp, weight, mean_h, rstd_h)))
    errs.update({name: rel_err(kdev.to_host(a), r)
                 for name, a, r in zip(("dinp", "dweight", "dbias"), (dinp, dweight, dbias), want)})
    # timing of backward, after compilation (the three launches: rows, then dweight/dbias in two stages)
    reps = 20
    args = [kdev.asarray(a) for a in (dout, inp, weight)]
    kdev.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        layernorm_backward(kdev, dinp, dweight, dbias, *args, mean, rstd)
    kdev.synchronize()
    ms = (time.perf_counter() - t0) / reps * 1e3
    print(f"layernorm B={B} T={T} C={C}: worst relative error {max(errs.values()):.2e} {errs}; "
          f"backward {ms:.3f} ms per call")
    # float32 storage, float64 sums (16384 rows for dweight, dbias): well inside 1e-5
    assert max(errs.values()) < 1e-5


# ---- the fast kernels: one warp per row ---------------------------------------------------------
@pytest.fixture
def wdev(kdev, monkeypatch):
    """kdev, able to run the warp-per-row kernels: a GPU as it is; the simulator, which has no warp shuffles,
    with cuda.shfl_xor_sync emulated: each thread posts its value, the block's live threads meet at a
    barrier, each reads lane ^ offset's value, and they meet again. Every live warp of a block shuffles the
    same number of times, and a warp lives or leaves as a whole, so the barriers always fill."""
    if kdev.kind != "sim":
        yield kdev
        return
    from numba.cuda.simulator.kernelapi import FakeCUDAModule
    posted = {}

    def shfl_xor_sync(self, mask, value, offset):
        me = threading.current_thread().thread_id
        posted[me] = value
        self.syncthreads()
        other = posted[me ^ offset]
        self.syncthreads()
        return other
    monkeypatch.setattr(FakeCUDAModule, "shfl_xor_sync", shfl_xor_sync, raising=False)
    # the simulator's block manager busy-polls for the barrier: switching threads every 50 us instead of
    # every 5 ms makes the 20 barriers per block here ~10x faster
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield kdev
    sys.setswitchinterval(interval)


def warp_geometry(dev, rows):
    """The layer's geometry on a GPU; in the simulator 2 warps per block (few threads, and a last block whose
    second warp has no row when rows is odd)."""
    return warp_rows_geometry(dev, rows) if dev.kind == "gpu" else (ceil_div(rows, 2), 2 * WARP)


# (6,20): C below one warp's 32 lanes; (37,45): odd rows (a warp with no row) and C not a multiple of 32
@pytest.mark.parametrize("shape", [(6, 20), (37, 45)])
def test_layernorm_forward_warp_kernel_matches_reference(wdev, rng, shape):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    out, mean, rstd = poisoned(wdev, shape), poisoned(wdev, shape[:1]), poisoned(wdev, shape[:1])
    wdev.launch(layernorm_forward_warp_kernel, *warp_geometry(wdev, shape[0]), out, mean, rstd,
                *(wdev.asarray(a) for a in (inp, weight, bias)))
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    # float64 sums as in the block kernel (another order); float32 inputs' products and stores: a few ulps
    for got, want in zip((out, mean, rstd), ref):
        assert rel_err(wdev.to_host(got), want) < 1e-6


@pytest.mark.parametrize("shape", [(6, 20), (37, 45)])
def test_layernorm_backward_warp_kernel_matches_reference_and_accumulates(wdev, rng, shape):
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=shape)
    dinp0 = rng.normal(size=shape)                        # accumulates: starts from random non-zero values
    inp, weight, mean, rstd, dout = (a.astype(np.float32) for a in (inp, weight, mean, rstd, dout))
    dinp = wdev.asarray(dinp0, np.float32)
    wdev.launch(layernorm_backward_inp_warp_kernel, *warp_geometry(wdev, shape[0]), dinp,
                *(wdev.asarray(a) for a in (dout, inp, weight, mean, rstd)))
    want = dinp0.copy()
    layernorm_backward_ref(want, np.zeros(shape[1]), np.zeros(shape[1]),
                           *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # float64 sums; float32 products (weight*dout, norm) and the float32 store: a few ulps per element
    assert rel_err(wdev.to_host(dinp), want) < 1e-6


# (16384,768): d12's B*T rows at B=16; (37,45): odd rows, a block with warps past the last row, C % 32 != 0
@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (37, 45)])
def test_layernorm_warp_kernels_match_float64_reference_and_repeat_bits_on_gpu(kdev, rng, N, C):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (N, C)))
    dout = rng.normal(size=(N, C)).astype(np.float32)
    x, w, b, dy = (kdev.asarray(a) for a in (inp, weight, bias, dout))
    # forward through the layer (the warp kernel on a GPU), twice into NaN-poisoned outputs
    runs = []
    for _ in range(2):
        out, mean, rstd = poisoned(kdev, (N, C)), poisoned(kdev, N), poisoned(kdev, N)
        layernorm_forward(kdev, out, mean, rstd, x, w, b)
        runs.append((out, mean, rstd))
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    errs = {name: rel_err(kdev.to_host(a), r) for name, a, r in zip(("out", "mean", "rstd"), runs[0], ref)}
    for a, b2 in zip(*runs):
        np.testing.assert_array_equal(kdev.to_host(a), kdev.to_host(b2))
    # backward through the layer, accumulating into random non-zero gradients, twice from the same start
    out, mean, rstd = runs[0]
    mean_h, rstd_h = kdev.to_host(mean), kdev.to_host(rstd)
    starts = [rng.normal(size=s).astype(np.float32) for s in ((N, C), C, C)]
    grads = []
    for _ in range(2):
        g = [kdev.asarray(a) for a in starts]
        layernorm_backward(kdev, *g, dy, x, w, mean, rstd)
        grads.append([kdev.to_host(a) for a in g])
    want = [a.astype(np.float64) for a in starts]
    layernorm_backward_ref(*want, *(a.astype(np.float64) for a in (dout, inp, weight, mean_h, rstd_h)))
    errs.update({name: rel_err(a, r) for name, a, r in zip(("dinp", "dweight", "dbias"), grads[0], want)})
    for a, b2 in zip(*grads):
        np.testing.assert_array_equal(a, b2)
    # time each warp kernel alone
    grid, block = warp_rows_geometry(kdev, N)
    ms_f = gpu_ms_per_call(kdev, lambda: kdev.launch(layernorm_forward_warp_kernel, grid, block,
                                                     out, mean, rstd, x, w, b))
    dinp = kdev.asarray(starts[0])
    ms_b = gpu_ms_per_call(kdev, lambda: kdev.launch(layernorm_backward_inp_warp_kernel, grid, block,
                                                     dinp, dy, x, w, mean, rstd))
    gb_f = (2 * N * C * 4) / ms_f / 1e6                 # read inp once from DRAM, write out
    gb_b = (4 * N * C * 4) / ms_b / 1e6                 # read dout, inp, dinp; write dinp
    print(f"layernorm warp kernels N={N} C={C}: worst relative error {max(errs.values()):.2e} {errs}; "
          f"forward {ms_f:.4f} ms ({gb_f:.0f} GB/s), backward dinp {ms_b:.4f} ms ({gb_b:.0f} GB/s) per call")
    # float64 sums, float32 inputs and stores: a few ulps per element (dweight, dbias: 16384-row sums in
    # float64, still a few ulps); 1e-6 leaves a margin of ~20x over the teaching kernels' measured 4.9e-8
    assert max(errs.values()) < 1e-6
