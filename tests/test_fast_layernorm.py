"""LayerNorm's fast kernels (llmz/fast/layernorm.py): the warp-per-row kernels (the register kernels up to
C = 1024, the loop kernels above) and the one-launch dweight/dbias kernel against the NumPy reference and the
teaching kernels (llmz/kernels/layernorm.py). In the simulator too (llmz.device emulates the warp shuffle),
the dweight/dbias kernel at odd geometries, in any block order, leaving its block counters at zero."""
import sys

import numpy as np
import pytest
from test_fast_column_sum import run_blocks_in_order
from test_layernorm import (
    assert_ln_forward,
    forward64,
    layernorm_bf16_against_float32,
    ln_forward_both,
    ln_grads,
    ln_inputs,
    ln_stats,
    make_inputs,
    widen,
)

import llmz.fast
from helpers import assert_within_one_step, gpu_ms_per_call, poisoned, rel_err
from llmz.bf16 import f32_to_bf16
from llmz.fast import layernorm as fast
from llmz.fast.column_sum import colsum_geometry
from llmz.fast.device_helpers import WARP
from llmz.fast.layernorm import (
    MAX_PER_LANE,
    ROWS_IN_FLIGHT,
    layernorm_backward_inp_warp_kernel,
    layernorm_backward_inp_warp_loop_kernel,
    layernorm_backward_params_kernel,
    layernorm_forward_warp_kernel,
    layernorm_forward_warp_loop_kernel,
    warp_kernels,
    warp_rows_geometry,
)
from llmz.kernels import layernorm as teaching
from llmz.kernels.grid import ceil_div
from llmz.kernels.layernorm import layernorm_backward_ref


@pytest.fixture(autouse=True)
def quick_barriers():
    """The simulator's block manager busy-polls for every syncthreads: switching Python threads every 50 us
    instead of every 5 ms makes the kernels' barriers several times faster (the emulated shuffle's ~10x)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(interval)


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
        lasts[order] = run_blocks_in_order(monkeypatch, order, rng, [fast])
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
def test_layernorm_forward_warp_kernel_matches_reference(fdev, rng, kind, shape):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    out, mean, rstd = poisoned(fdev, shape), poisoned(fdev, shape[:1]), poisoned(fdev, shape[:1])
    fdev.launch(WARP_KERNELS[kind][0], *warp_geometry(fdev, shape[0]), out, mean, rstd,
                *(fdev.asarray(a) for a in (inp, weight, bias)))
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    # registers: each lane's <= 32 values summed in float32, the lanes in float64 (the loop kernel: float64
    # throughout); float32 inputs' products and stores: a few ulps
    for got, want in zip((out, mean, rstd), ref):
        assert rel_err(fdev.to_host(got), want) < 1e-6


@pytest.mark.parametrize("kind, shape", WARP_CASES)
def test_layernorm_backward_warp_kernel_matches_reference_and_accumulates(fdev, rng, kind, shape):
    inp, weight, bias = make_inputs(rng, shape)
    _, mean, rstd = forward64(inp, weight, bias)
    dout = rng.normal(size=shape)
    dinp0 = rng.normal(size=shape)                        # accumulates: starts from random non-zero values
    inp, weight, mean, rstd, dout = (a.astype(np.float32) for a in (inp, weight, mean, rstd, dout))
    dinp = fdev.asarray(dinp0, np.float32)
    fdev.launch(WARP_KERNELS[kind][1], *warp_geometry(fdev, shape[0]), dinp,
                *(fdev.asarray(a) for a in (dout, inp, weight, mean, rstd)))
    want = dinp0.copy()
    layernorm_backward_ref(want, np.zeros(shape[1]), np.zeros(shape[1]),
                           *(a.astype(np.float64) for a in (dout, inp, weight, mean, rstd)))
    # lane sums in float32 (registers) or float64 (loop); float32 products (weight*dout, norm) and the float32
    # store: a few ulps per element
    assert rel_err(fdev.to_host(dinp), want) < 1e-6


def test_layernorm_register_kernels_and_params_kernels_keep_float64_inputs_in_float64(fdev, rng):
    shape = (5, 45)
    inp, weight, bias = make_inputs(rng, shape)
    dout, dinp0, dweight0, dbias0 = (rng.normal(size=s) for s in (shape, shape, 45, 45))
    forward_kernel, backward_kernel = WARP_KERNELS["registers"]
    geometry = warp_geometry(fdev, shape[0])
    out, mean, rstd = poisoned(fdev, shape, np.float64), poisoned(fdev, 5, np.float64), poisoned(fdev, 5, np.float64)
    fdev.launch(forward_kernel, *geometry, out, mean, rstd, *(fdev.asarray(a, np.float64) for a in (inp, weight, bias)))
    ref = forward64(inp, weight, bias)
    # backward: the register kernel for dinp, the layer's two stages for dweight, dbias, all from random starts
    grads = [fdev.asarray(a, np.float64) for a in (dinp0, dweight0, dbias0)]
    args = [fdev.asarray(a, np.float64) for a in (dout, inp, weight, ref[1], ref[2])]
    fdev.launch(backward_kernel, *geometry, grads[0], *args)
    fast.layernorm_backward(fdev, fdev.asarray(np.zeros(shape)), *grads[1:], *args)
    want = [dinp0.copy(), dweight0.copy(), dbias0.copy()]
    layernorm_backward_ref(*want, dout, inp, weight, ref[1], ref[2])
    # the compute dtype follows the arrays: float64 sums and products, other orders than NumPy's
    for got, r in zip((out, mean, rstd, *grads), (*ref, *want)):
        assert rel_err(fdev.to_host(got), r) < 1e-13


# odd rows: the last block's second warp has no row; the register kernels (C <= 1024) and the loop kernels
@pytest.mark.parametrize("kind", ["registers", "loop"])
@pytest.mark.parametrize("shape", [(7, 45)])
def test_layernorm_warp_kernels_on_bf16_are_the_rounded_float32_kernels(fdev, rng, shape, kind):
    forward_kernel, backward_kernel = WARP_KERNELS[kind]
    inp, weight, bias = ln_inputs(rng, shape)
    geometry = warp_geometry(fdev, shape[0])
    got, want32 = ln_forward_both(fdev, inp, weight, bias,
                                  lambda *a: fdev.launch(forward_kernel, *geometry, *a))
    assert_ln_forward(got, want32, inp, weight, bias)
    # backward, rows part: accumulates into dinp (random start)
    mean, rstd = ln_stats(inp, weight, bias)
    dout, dinp0 = ln_grads(rng, shape)[:2]
    outs = []
    for conv in (lambda a: a, widen):
        dinp = fdev.asarray(conv(dinp0))
        fdev.launch(backward_kernel, *geometry, dinp,
                    *(fdev.asarray(conv(a)) for a in (dout, inp, weight)), fdev.asarray(mean), fdev.asarray(rstd))
        outs.append(fdev.to_host(dinp))
    np.testing.assert_array_equal(outs[0], f32_to_bf16(outs[1]))
    ref = dinp0.copy()
    layernorm_backward_ref(ref, np.zeros(shape[1], np.float32), np.zeros(shape[1], np.float32),
                           dout, inp, weight, mean, rstd)
    assert_within_one_step(outs[0], ref, atol=1e-4)


# (16384,768): d12's B*T rows at B=16 (the register kernels); (37,45): odd rows, a block with warps past the
# last row, C % 32 != 0; (4096,80): C % 32 != 0, lanes with 2 or 3 channels; (4096,1024): every register slot;
# (4096,1600): d48's C, the loop kernels
@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (37, 45), (4096, 80), (4096, 1024), (4096, 1600)])
def test_layernorm_warp_kernels_match_float64_reference_and_repeat_bits_on_gpu(fdev, rng, N, C):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (N, C)))
    dout = rng.normal(size=(N, C)).astype(np.float32)
    x, w, b, dy = (fdev.asarray(a) for a in (inp, weight, bias, dout))
    # forward through the layer (the warp kernels on a GPU), twice into NaN-poisoned outputs
    runs = []
    for _ in range(2):
        out, mean, rstd = poisoned(fdev, (N, C)), poisoned(fdev, N), poisoned(fdev, N)
        fast.layernorm_forward(fdev, out, mean, rstd, x, w, b)
        runs.append((out, mean, rstd))
    ref = forward64(*(a.astype(np.float64) for a in (inp, weight, bias)))
    errs = {name: rel_err(fdev.to_host(a), r) for name, a, r in zip(("out", "mean", "rstd"), runs[0], ref)}
    for a, b2 in zip(*runs):
        np.testing.assert_array_equal(fdev.to_host(a), fdev.to_host(b2))
    # backward through the layer, accumulating into random non-zero gradients, twice from the same start
    out, mean, rstd = runs[0]
    mean_h, rstd_h = fdev.to_host(mean), fdev.to_host(rstd)
    starts = [rng.normal(size=s).astype(np.float32) for s in ((N, C), C, C)]
    grads = []
    for _ in range(2):
        g = [fdev.asarray(a) for a in starts]
        fast.layernorm_backward(fdev, *g, dy, x, w, mean, rstd)
        grads.append([fdev.to_host(a) for a in g])
    want = [a.astype(np.float64) for a in starts]
    layernorm_backward_ref(*want, *(a.astype(np.float64) for a in (dout, inp, weight, mean_h, rstd_h)))
    errs.update({name: rel_err(a, r) for name, a, r in zip(("dinp", "dweight", "dbias"), grads[0], want)})
    for a, b2 in zip(*grads):
        np.testing.assert_array_equal(a, b2)
    # time each kernel alone: the layer's warp kernels, then the dweight/dbias kernel (both stages)
    forward_kernel, backward_kernel = warp_kernels(C)
    grid, block = warp_rows_geometry(N)
    ms_f = gpu_ms_per_call(fdev, lambda: fdev.launch(forward_kernel, grid, block, out, mean, rstd, x, w, b))
    dinp = fdev.asarray(starts[0])
    ms_b = gpu_ms_per_call(fdev, lambda: fdev.launch(backward_kernel, grid, block, dinp, dy, x, w, mean, rstd))
    pgrid, pblock, R, rows = colsum_geometry(fdev, N, C)
    part_w, part_b = fdev.zeros((R, C), np.float64), fdev.zeros((R, C), np.float64)
    counters = fdev.zeros(pgrid[0], np.int32)
    dweight, dbias = fdev.asarray(starts[1]), fdev.asarray(starts[2])
    ms_p = gpu_ms_per_call(fdev, lambda: fdev.launch(layernorm_backward_params_kernel, pgrid, pblock, dweight,
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


def test_layernorm_fast_layers_match_the_teaching_layers(kdev, fdev, rng):
    # (9,80): odd rows (a warp with no row), C % 32 != 0 and a register slot filled in some lanes only; the
    # params kernel over two row chunks (the simulator's 8 rows a chunk), the second of one row
    shape = (9, 80)
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, shape))
    dout = rng.normal(size=shape).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in (shape, shape[1], shape[1])]
    got = {}
    for name, dev, k in (("teaching", kdev, teaching), ("fast", fdev, fast)):
        x, w, b, dy = (dev.asarray(a) for a in (inp, weight, bias, dout))
        out, mean, rstd = poisoned(dev, shape), poisoned(dev, shape[:1]), poisoned(dev, shape[:1])
        k.layernorm_forward(dev, out, mean, rstd, x, w, b)
        grads = [dev.asarray(a) for a in starts]
        k.layernorm_backward(dev, *grads, dy, x, w, mean, rstd)
        got[name] = [dev.to_host(a) for a in (out, mean, rstd, *grads)]
    # not the same bits (the sums group differently): both within a few float32 ulps of float64, so of each other
    for what, t, f in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"), got["teaching"], got["fast"]):
        assert rel_err(f, t) < 2e-6, what


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (4096, 1600)])
def test_layernorm_fast_layers_match_the_teaching_layers_at_gpt2_size(kdev, fdev, rng, N, C):
    inp, weight, bias = (a.astype(np.float32) for a in make_inputs(rng, (N, C)))
    dout = rng.normal(size=(N, C)).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) for s in ((N, C), C, C)]
    got = {}
    for name, dev, k in (("teaching", kdev, teaching), ("fast", fdev, fast)):
        x, w, b, dy = (dev.asarray(a) for a in (inp, weight, bias, dout))
        out, mean, rstd = poisoned(dev, (N, C)), poisoned(dev, N), poisoned(dev, N)
        k.layernorm_forward(dev, out, mean, rstd, x, w, b)
        grads = [dev.asarray(a) for a in starts]
        k.layernorm_backward(dev, *grads, dy, x, w, mean, rstd)
        got[name] = [dev.to_host(a) for a in (out, mean, rstd, *grads)]
    errs = {what: rel_err(f, t) for what, t, f in zip(("out", "mean", "rstd", "dinp", "dweight", "dbias"),
                                                       got["teaching"], got["fast"])}
    print(f"layernorm N={N} C={C}: fast vs teaching, relative difference {errs}")
    assert max(errs.values()) < 2e-6


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (4096, 1600)])      # the register kernels; the loop kernels
def test_layernorm_fast_bf16_kernels_match_float32_kernels_at_gpt2_size(fdev, rng, N, C):
    layernorm_bf16_against_float32(fdev, llmz.fast, rng, N, C)
