"""LayerNorm: the kernels against the NumPy reference, the reference against finite differences. The fast
warp-per-row kernels (GPU only in the layer: the register kernels up to C = 1024, the loop kernels above) run in
the simulator too, with an emulated warp shuffle; the dweight/dbias kernel (both paths) at odd geometries, in
any block order (its stage 2 runs in each strip's last block), leaving its block counters at zero."""
import sys
import threading
import time

import numpy as np
import pytest
from test_reduce import run_blocks_in_order

from helpers import finite_diff, gpu_ms_per_call, poisoned, rel_err
from llmz.device import ceil_div
from llmz.kernels import layernorm
from llmz.kernels.layernorm import (
    MAX_PER_LANE,
    ROWS_IN_FLIGHT,
    WARP,
    layernorm_backward,
    layernorm_backward_inp_warp_kernel,
    layernorm_backward_inp_warp_loop_kernel,
    layernorm_backward_params_kernel,
    layernorm_backward_ref,
    layernorm_forward,
    layernorm_forward_ref,
    layernorm_forward_warp_kernel,
    layernorm_forward_warp_loop_kernel,
    warp_kernels,
    warp_rows_geometry,
)
from llmz.kernels.reduce import colsum_geometry


@pytest.fixture(autouse=True)
def quick_barriers():
    """The simulator's block manager busy-polls for every syncthreads: switching Python threads every 50 us
    instead of every 5 ms makes the kernels' barriers several times faster (the warp kernels' 20 per block
    with the emulated shuffle ~10x)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(interval)


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
    # each launch's last blocks reset their strips' counters (the second launch counted from zero)
    counters = kdev.scratch("layernorm_params_count", ceil_div(45, 32), np.int32)
    np.testing.assert_array_equal(kdev.to_host(counters), 0)


# the dweight/dbias kernel alone, at geometries the layer does not pick. In the simulator (4 lanes):
# (90, 40, 40): two strips (the second 8 channels wide), 3 row chunks (the last 10 rows), 10 rows a thread in
# stage 1 (a full batch of ROWS_IN_FLIGHT=8, then a partial one); (72, 20, 8): one partial strip, 2 rows a thread
# (a partial batch), 9 partial sums for stage 2's 4 lanes (3, 2, 2, 2)
@pytest.mark.parametrize("N, C, rows_per_block", [(90, 40, 40), (72, 20, 8)])
def test_layernorm_params_kernel_matches_reference_in_row_batches(kdev, rng, N, C, rows_per_block):
    inp, weight, bias = make_inputs(rng, (N, C))
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=(N, C))
    dweight0, dbias0 = rng.normal(size=C), rng.normal(size=C)      # accumulates: random non-zero starts
    inp, mean, rstd, dout = (a.astype(np.float32) for a in (inp, mean, rstd, dout))
    grid, block, R, rows = colsum_geometry(kdev, N, C, rows_per_block)
    assert R == ceil_div(N, rows_per_block) > 1 and ROWS_IN_FLIGHT == 8    # the batches counted above
    part_w, part_b = poisoned(kdev, (R, C), np.float64), poisoned(kdev, (R, C), np.float64)
    counters = kdev.zeros(grid[0], np.int32)
    dweight, dbias = kdev.asarray(dweight0, np.float32), kdev.asarray(dbias0, np.float32)
    kdev.launch(layernorm_backward_params_kernel, grid, block, dweight, dbias, part_w, part_b, counters,
                *(kdev.asarray(a) for a in (dout, inp, mean, rstd)), rows)
    np.testing.assert_array_equal(kdev.to_host(counters), 0)           # reset by each strip's last block
    want = [np.zeros((N, C)), dweight0.copy(), dbias0.copy()]
    layernorm_backward_ref(*want, *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # each batch of 8 rows summed in float32, the batches, lanes and chunks in float64; float32 norm * dout and
    # the float32 store: a few ulps
    assert rel_err(kdev.to_host(dweight), want[1]) < 1e-6
    assert rel_err(kdev.to_host(dbias), want[2]) < 1e-6


# (20, 40) in 3 chunks of 8 rows (the last 4), two strips: the strip's stage 2 in chunk 2's block (grid order),
# chunk 0's (reversed) or any (shuffled); the same bits each time (the simulator runs blocks one at a time: what
# is shown is that the result does not depend on which block counts last)
def test_layernorm_params_kernel_bits_do_not_depend_on_which_block_finishes_last(kdev, rng, monkeypatch):
    if kdev.kind != "sim":
        pytest.skip("changes the simulator's block order")
    N, C = 20, 40
    inp, weight, bias = make_inputs(rng, (N, C))
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))   # magnitudes apart: order shows
    dout, inp, mean, rstd = (a.astype(np.float32) for a in (dout, inp, mean, rstd))
    starts = [rng.normal(size=C).astype(np.float32) for _ in range(2)]
    grid, block, R, rows = colsum_geometry(kdev, N, C)
    part_w, part_b = kdev.zeros((R, C), np.float64), kdev.zeros((R, C), np.float64)
    counters = kdev.zeros(grid[0], np.int32)
    got, lasts = {}, {}
    for order in ("grid", "reversed", "shuffled"):
        monkeypatch.undo()
        lasts[order] = run_blocks_in_order(monkeypatch, order, rng, [layernorm])
        dweight, dbias = (kdev.asarray(a) for a in starts)
        kdev.launch(layernorm_backward_params_kernel, grid, block, dweight, dbias, part_w, part_b, counters,
                    *(kdev.asarray(a) for a in (dout, inp, mean, rstd)), rows)
        got[order] = [kdev.to_host(dweight), kdev.to_host(dbias)]
        np.testing.assert_array_equal(kdev.to_host(counters), 0)
    assert R == 3 and sorted(lasts["grid"]) == [(0, 2), (1, 2)] and sorted(lasts["reversed"]) == [(0, 0), (1, 0)]
    assert len(lasts["shuffled"]) == 2
    for order in ("reversed", "shuffled"):
        for a, b in zip(got["grid"], got[order]):
            np.testing.assert_array_equal(a, b)
    want = [a.astype(np.float64) for a in starts]
    layernorm_backward_ref(np.zeros((N, C)), *want, *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # batches of 8 rows in float32, then float64; float32 products and stores: a few ulps
    for a, w in zip(got["grid"], want):
        assert rel_err(a, w) < 1e-6


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
    # timing of backward, after compilation (the two launches: rows, then dweight/dbias)
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
    yield kdev


def warp_geometry(dev, rows):
    """The layer's geometry on a GPU; in the simulator 2 warps per block (few threads, and a last block whose
    second warp has no row when rows is odd)."""
    return warp_rows_geometry(rows) if dev.kind == "gpu" else (ceil_div(rows, 2), 2 * WARP)


# (forward, backward rows) kernels: registers (the layer's for C <= 32 * MAX_PER_LANE), loop (above)
WARP_KERNELS = {"registers": (layernorm_forward_warp_kernel, layernorm_backward_inp_warp_kernel),
                "loop": (layernorm_forward_warp_loop_kernel, layernorm_backward_inp_warp_loop_kernel)}
# (6,20): C below one warp's 32 lanes; (37,45): odd rows (a warp with no row) and C % 32 != 0; (3,80): a lane's
# third register slot filled in some lanes only; (3,1024): every slot of every lane (C = 32 * MAX_PER_LANE)
WARP_SHAPES = [(6, 20), (37, 45), (3, 80), (3, 1024)]
WARP_CASES = [pytest.param(kind, shape, id=f"{kind}-{shape[0]}x{shape[1]}")
              for kind, shape in [(k, s) for k in WARP_KERNELS for s in WARP_SHAPES] + [("loop", (3, 1600))]]


def test_layer_picks_the_register_kernels_up_to_1024_channels():
    assert MAX_PER_LANE * WARP == 1024
    for C in (20, 45, 768, 1024):
        assert warp_kernels(C) == WARP_KERNELS["registers"]
    for C in (1025, 1280, 1600):
        assert warp_kernels(C) == WARP_KERNELS["loop"]


@pytest.mark.parametrize("kind, shape", WARP_CASES)
def test_layernorm_forward_warp_kernel_matches_reference(wdev, rng, kind, shape):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    out, mean, rstd = poisoned(wdev, shape), poisoned(wdev, shape[:1]), poisoned(wdev, shape[:1])
    wdev.launch(WARP_KERNELS[kind][0], *warp_geometry(wdev, shape[0]), out, mean, rstd,
                *(wdev.asarray(a) for a in (inp, weight, bias)))
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    # registers: each lane's <= 32 values summed in float32, the lanes in float64 (the loop kernel: float64
    # throughout); float32 inputs' products and stores: a few ulps
    for got, want in zip((out, mean, rstd), ref):
        assert rel_err(wdev.to_host(got), want) < 1e-6


@pytest.mark.parametrize("kind, shape", WARP_CASES)
def test_layernorm_backward_warp_kernel_matches_reference_and_accumulates(wdev, rng, kind, shape):
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=shape)
    dinp0 = rng.normal(size=shape)                        # accumulates: starts from random non-zero values
    inp, weight, mean, rstd, dout = (a.astype(np.float32) for a in (inp, weight, mean, rstd, dout))
    dinp = wdev.asarray(dinp0, np.float32)
    wdev.launch(WARP_KERNELS[kind][1], *warp_geometry(wdev, shape[0]), dinp,
                *(wdev.asarray(a) for a in (dout, inp, weight, mean, rstd)))
    want = dinp0.copy()
    layernorm_backward_ref(want, np.zeros(shape[1]), np.zeros(shape[1]),
                           *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # lane sums in float32 (registers) or float64 (loop); float32 products (weight*dout, norm) and the float32
    # store: a few ulps per element
    assert rel_err(wdev.to_host(dinp), want) < 1e-6


def test_layernorm_register_kernels_and_params_kernels_keep_float64_inputs_in_float64(wdev, rng):
    shape = (5, 45)
    inp, weight, bias = make_inputs(rng, shape)
    dout, dinp0, dweight0, dbias0 = (rng.normal(size=s) for s in (shape, shape, 45, 45))
    forward_kernel, backward_kernel = WARP_KERNELS["registers"]
    geometry = warp_geometry(wdev, shape[0])
    out, mean, rstd = poisoned(wdev, shape, np.float64), poisoned(wdev, 5, np.float64), poisoned(wdev, 5, np.float64)
    wdev.launch(forward_kernel, *geometry, out, mean, rstd, *(wdev.asarray(a, np.float64) for a in (inp, weight, bias)))
    ref = forward64(inp, weight, bias)
    # backward: the register kernel for dinp, the layer's two stages for dweight, dbias, all from random starts
    grads = [wdev.asarray(a, np.float64) for a in (dinp0, dweight0, dbias0)]
    args = [wdev.asarray(a, np.float64) for a in (dout, inp, weight, ref[1], ref[2])]
    wdev.launch(backward_kernel, *geometry, grads[0], *args)
    layernorm_backward(wdev, wdev.asarray(np.zeros(shape)), *grads[1:], *args)
    want = [dinp0.copy(), dweight0.copy(), dbias0.copy()]
    layernorm_backward_ref(*want, dout, inp, weight, ref[1], ref[2])
    # the compute dtype follows the arrays: float64 sums and products, other orders than NumPy's
    for got, r in zip((out, mean, rstd, *grads), (*ref, *want)):
        assert rel_err(wdev.to_host(got), r) < 1e-13


# (16384,768): d12's B*T rows at B=16 (the register kernels); (37,45): odd rows, a block with warps past the
# last row, C % 32 != 0; (4096,80): C % 32 != 0, lanes with 2 or 3 channels; (4096,1024): every register slot;
# (4096,1600): d48's C, the loop kernels
@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (37, 45), (4096, 80), (4096, 1024), (4096, 1600)])
def test_layernorm_warp_kernels_match_float64_reference_and_repeat_bits_on_gpu(kdev, rng, N, C):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (N, C)))
    dout = rng.normal(size=(N, C)).astype(np.float32)
    x, w, b, dy = (kdev.asarray(a) for a in (inp, weight, bias, dout))
    # forward through the layer (the warp kernels on a GPU), twice into NaN-poisoned outputs
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
    # time each kernel alone: the layer's warp kernels, then the dweight/dbias kernel (both stages)
    forward_kernel, backward_kernel = warp_kernels(C)
    grid, block = warp_rows_geometry(N)
    ms_f = gpu_ms_per_call(kdev, lambda: kdev.launch(forward_kernel, grid, block, out, mean, rstd, x, w, b))
    dinp = kdev.asarray(starts[0])
    ms_b = gpu_ms_per_call(kdev, lambda: kdev.launch(backward_kernel, grid, block, dinp, dy, x, w, mean, rstd))
    pgrid, pblock, R, rows = colsum_geometry(kdev, N, C)
    part_w, part_b = kdev.zeros((R, C), np.float64), kdev.zeros((R, C), np.float64)
    counters = kdev.zeros(pgrid[0], np.int32)
    dweight, dbias = kdev.asarray(starts[1]), kdev.asarray(starts[2])
    ms_p = gpu_ms_per_call(kdev, lambda: kdev.launch(layernorm_backward_params_kernel, pgrid, pblock, dweight,
                                                     dbias, part_w, part_b, counters, dy, x, mean, rstd, rows))
    gb_f = (2 * N * C * 4) / ms_f / 1e6                 # read inp once from DRAM, write out
    gb_b = (4 * N * C * 4) / ms_b / 1e6                 # read dout, inp, dinp; write dinp
    gb_p = (2 * N * C * 4) / ms_p / 1e6                 # read dout, inp
    print(f"layernorm warp kernels N={N} C={C} ({forward_kernel.py_func.__name__}): worst relative error "
          f"{max(errs.values()):.2e} {errs}; forward {ms_f:.4f} ms ({gb_f:.0f} GB/s), backward dinp {ms_b:.4f} ms "
          f"({gb_b:.0f} GB/s), dweight/dbias {ms_p:.4f} ms ({gb_p:.0f} GB/s; stage 2 over {R} partials) per call")
    # lane sums in float32 over <= 32 values then float64 (registers; float64 throughout in the loop kernels),
    # float32 inputs and stores: a few ulps per element (a NumPy model of the register kernels at d12's size:
    # 6e-8); dweight, dbias: batches of 8 rows in float32, then float64; 1e-6 leaves a wide margin
    assert max(errs.values()) < 1e-6
