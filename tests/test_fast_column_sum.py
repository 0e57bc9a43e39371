"""The one-launch column sums (llmz/fast/column_sum.py, matmul's fast bias gradient and layernorm's pieces)
against float64 sums and the teaching kernel they replace (llmz/kernels/matmul.py's
matmul_backward_bias_kernel): deterministic; sizes off the chunk grid; the documented order; stage 2 in each
strip's last block whichever block that is (the simulator's block order changed), the block counters left at
zero; the paired kernel the scalar kernel's bits."""
import sys
import threading
import time

import numpy as np
import pytest

from helpers import assert_within_one_step, gpu_ms_per_call, poisoned, rand_bf16, rel_err, ulps_apart
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.fast import column_sum as colsum
from llmz.fast.column_sum import (
    COLSUM_PAIR_STRIP,
    colsum_geometry,
    column_sum,
    column_sum_kernel,
    column_sum_pairs_kernel,
    pairs_fit,
)
from llmz.fast.device_helpers import pair_view
from llmz.kernels.grid import ceil_div
from llmz.kernels.matmul import matmul_backward_bias_kernel


@pytest.fixture(autouse=True)
def quick_barriers():
    """The simulator's block manager busy-polls for every syncthreads: switching Python threads every 50 us
    instead of every 5 ms makes the kernels' barriers (5 a block here) several times faster."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(interval)


def sums64(start, x):
    """start + the float64 column sums of x (..., C)."""
    return np.asarray(start, np.float64) + np.asarray(x, np.float64).reshape(-1, x.shape[-1]).sum(axis=0)


def teaching_bias(dev, start, x):
    """The teaching kernel's column sums: start + x's rows, one thread per column (host arrays in and out)."""
    out = dev.asarray(start)
    x2 = x.reshape(-1, x.shape[-1])
    dev.launch(matmul_backward_bias_kernel, ceil_div(x2.shape[1], dev.block_size), dev.block_size, out,
               dev.asarray(x2))
    return dev.to_host(out)


# (37,45): N not a multiple of the chunk (8 rows in the simulator) nor of the lanes (4), C of the 32-column
# strip; (3,5): fewer rows than one chunk, fewer columns than one strip; rows_per_block=5: chunk not a
# multiple of the lanes; (0,7): no rows at all
@pytest.mark.parametrize("shape, rows_per_block", [((37, 45), None), ((3, 5), None), ((37, 45), 5),
                                                   ((0, 7), None)])
def test_column_sum_kernel_matches_float64_sums_and_the_teaching_kernel(fdev, rng, shape, rows_per_block):
    C = shape[1]
    x = rng.normal(size=shape).astype(np.float32)
    start = rng.normal(size=C).astype(np.float32)                  # accumulates: start from random values
    out = fdev.asarray(start)
    column_sum(fdev, out, fdev.asarray(x), rows_per_block=rows_per_block)
    got = fdev.to_host(out)
    # float64 sums of float32 inputs, one float32 rounding of start + sum: an ulp or so
    assert rel_err(got, sums64(start, x)) < 1e-6
    # the teaching kernel: the same float64 sum in another order, one rounding: at most an ulp apart
    assert ulps_apart(got, teaching_bias(fdev, start, x)).max() <= 1


def test_column_sum_kernel_float64_input_and_3d_rows(fdev, rng):
    x = rng.normal(size=(3, 11, 40))
    start = rng.normal(size=40)
    out = fdev.asarray(start)
    column_sum(fdev, out, fdev.asarray(x))
    # float64 throughout, only the summation order differs
    assert rel_err(fdev.to_host(out), sums64(start, x)) < 1e-14


def test_column_sum_kernel_gives_the_same_bits_twice(fdev, rng):
    x = fdev.asarray(rng.normal(size=(37, 45)).astype(np.float32) * 1e3)
    start = rng.normal(size=45).astype(np.float32)
    got = []
    for _ in range(2):
        out = fdev.asarray(start)
        column_sum(fdev, out, x)
        got.append(fdev.to_host(out))
    np.testing.assert_array_equal(got[0], got[1])


def lanes_model(x, first_row, end, lanes):
    """The kernels' order over rows [first_row, end) of x (R,C) float64, all columns at once: lane l adds rows
    first_row + l, + 2 lanes, ... in row order from 0.0, then the lanes are added in lane order from 0.0."""
    s = np.zeros(x.shape[1])
    for lane in range(lanes):
        acc = np.zeros(x.shape[1])
        for r in range(first_row + lane, end, lanes):
            acc += x[r]
        s += acc
    return s


# rows_per_block 37 (one chunk): 9 or 10 rows per lane (4 lanes in the simulator), so stage 1 takes the
# eight-loads-at-a-time path and its tail; rows_per_block 1: 37 partials, 9 or 10 per lane, so stage 2 does
@pytest.mark.parametrize("rows_per_block", [37, 1])
def test_column_sum_kernel_adds_in_the_documented_fixed_order(fdev, rng, rows_per_block):
    N, C = 37, 20
    x = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))   # magnitudes apart: order shows
    start = rng.normal(size=C)
    out = fdev.asarray(start)
    column_sum(fdev, out, fdev.asarray(x), rows_per_block=rows_per_block)
    # the model: stage 1 per chunk, stage 2 over the partials, both in lanes (float64 throughout)
    _, block, R, rows = colsum_geometry(fdev, N, C, rows_per_block)
    lanes = block[1]
    partial = np.stack([lanes_model(x, y * rows, min((y + 1) * rows, N), lanes) for y in range(R)])
    want = start + lanes_model(partial, 0, R, lanes)
    # float64 adds in the same order: the same bits
    np.testing.assert_array_equal(fdev.to_host(out), want)


# rows_per_block 8 (the simulator's chunk): R = 5, the last chunk 5 rows; 64: R = 1, the only block is the last
@pytest.mark.parametrize("rows_per_block", [8, 64])
def test_column_sum_kernel_twice_in_a_row_is_right_and_leaves_the_counters_zero(fdev, rng, rows_per_block):
    N, C = 37, 45                                    # two strips, the second 13 columns wide
    grid, block, R, rows = colsum_geometry(fdev, N, C, rows_per_block)
    assert R == ceil_div(N, rows_per_block) and grid[0] == 2
    partial = poisoned(fdev, (R, C), np.float64)
    counters = fdev.zeros(grid[0], np.int32)
    # the second launch (other x) counts from the zero the first one left
    for _ in range(2):
        x, start = rng.normal(size=(N, C)), rng.normal(size=C)
        out = fdev.asarray(start)
        fdev.launch(column_sum_kernel, grid, block, out, partial, counters, fdev.asarray(x), rows)
        # float64 throughout, only the summation order differs
        assert rel_err(fdev.to_host(out), sums64(start, x)) < 1e-14
        np.testing.assert_array_equal(fdev.to_host(counters), 0)


def run_blocks_in_order(monkeypatch, order, rng, modules):
    """In the simulator, which runs a launch's blocks one at a time in grid order: from now on (until
    monkeypatch undoes it) run them in `order`: "grid", "reversed", or "shuffled" (a permutation from rng).
    Returns a list that collects the (blockIdx.x, blockIdx.y) of every block whose last_in_strip answered True,
    as seen through the given kernel modules (the simulator looks the device function up at call time)."""
    from numba.cuda.simulator import kernel as simulator

    def ndindex(*shape):
        points = list(np.ndindex(*shape))
        if order == "reversed":
            return points[::-1]
        return [points[i] for i in rng.permutation(len(points))] if order == "shuffled" else points

    class NumpyWithOrder:
        def __getattr__(self, name):
            return getattr(np, name)
    numpy_with_order = NumpyWithOrder()
    numpy_with_order.ndindex = ndindex
    # the grid's blocks (and each block's threads, started in the same order: they run concurrently anyway)
    monkeypatch.setattr(simulator, "np", numpy_with_order)
    last_blocks = []
    last_in_strip = colsum.last_in_strip

    def recording(flag, counters):
        last = last_in_strip(flag, counters)
        t = threading.current_thread()
        if last and t.threadIdx.x == 0 and t.threadIdx.y == 0:
            last_blocks.append((t.blockIdx.x, t.blockIdx.y))
        return last
    for module in modules:
        monkeypatch.setattr(module, "last_in_strip", recording)
    return last_blocks


# (37,45) in 5 chunks of 8 rows, two strips: the last block of each strip is chunk 4 in grid order, chunk 0 in
# reversed order, any chunk shuffled; the sums are the same bits, the documented order's (the simulator runs
# blocks one at a time, so a block never sees another one half done: what is shown here is that the result
# does not depend on which block counts last)
def test_column_sum_kernel_bits_do_not_depend_on_which_block_finishes_last(fdev, rng, monkeypatch):
    if fdev.kind != "sim":
        pytest.skip("changes the simulator's block order")
    N, C = 37, 45
    x = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))   # magnitudes apart: order shows
    start = rng.normal(size=C)
    grid, block, R, rows = colsum_geometry(fdev, N, C)
    got, lasts = {}, {}
    for order in ("grid", "reversed", "shuffled"):
        monkeypatch.undo()
        lasts[order] = run_blocks_in_order(monkeypatch, order, rng, [colsum])
        out = fdev.asarray(start)
        column_sum(fdev, out, fdev.asarray(x))
        got[order] = fdev.to_host(out)
    assert sorted(lasts["grid"]) == [(0, R - 1), (1, R - 1)]
    assert sorted(lasts["reversed"]) == [(0, 0), (1, 0)]
    assert len(lasts["shuffled"]) == 2
    partial = np.stack([lanes_model(x, y * rows, min((y + 1) * rows, N), block[1]) for y in range(R)])
    want = start + lanes_model(partial, 0, R, block[1])
    for bits in got.values():
        np.testing.assert_array_equal(bits, want)
    np.testing.assert_array_equal(fdev.to_host(fdev.scratch("colsum_count", grid[0], np.int32)), 0)


def test_colsum_geometry_covers_every_row_and_column(fdev):
    grid, block, R, rows = colsum_geometry(fdev, 37, 45)
    assert grid[0] * block[0] >= 45 and grid[1] == R and R * rows >= 37 > (R - 1) * rows


@pytest.mark.gpu
def test_column_sum_kernel_matches_float64_reference_at_gpt2_size(fdev, rng):
    N, C = 16384, 768
    x = rng.normal(size=(N, C)).astype(np.float32)
    start = rng.normal(size=C).astype(np.float32)
    want = sums64(start, x)
    xd = fdev.asarray(x)
    out = fdev.asarray(start)
    column_sum(fdev, out, xd)
    err = rel_err(fdev.to_host(out), want)
    # timing: the same launches again, after compilation
    reps = 20
    fdev.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        column_sum(fdev, out, xd)
    fdev.synchronize()
    ms = (time.perf_counter() - t0) / reps * 1e3
    print(f"column_sum N={N} C={C}: worst relative error {err:.2e}, {ms:.3f} ms per call (1 launch)")
    # float64 sums of 16384 float32 values, one float32 rounding at the end
    assert err < 1e-6


# ---- the paired kernel: words of two columns, the same bits as column_sum_kernel --------------------------
def launch_both(dev, x, start, rows_per_block, lanes=None):
    """column_sum_kernel and column_sum_pairs_kernel on the same x (N,C) and out start, the same rows_per_block
    and lanes (None: the device's). Returns ((out, partial, counters) of the scalar kernel, the same of the paired
    one), on the host."""
    N, C = x.shape
    runs = []
    for kernel, pairs in ((column_sum_kernel, False), (column_sum_pairs_kernel, True)):
        grid, block, R, rows = colsum_geometry(dev, N, C, rows_per_block, pairs)
        block = (block[0], lanes or block[1])
        out = dev.asarray(start)
        partial = poisoned(dev, (R, C), np.float64)
        counters = dev.zeros(grid[0], np.int32)
        xd = dev.asarray(x)
        dev.launch(kernel, grid, block, out, partial, counters, pair_view(xd) if pairs else xd, rows)
        runs.append([dev.to_host(a) for a in (out, partial, counters)])
    return runs


# C = 70: a full 64-column strip and one of 6 (3 words), 3 strips of 32 for the scalar kernel. N = 21 rows:
# rows_per_block 21 with 2 lanes: R = 1, 10 or 11 rows a lane (stage 1's eight loads at a time and its tail);
# 8 with 4 lanes: R = 3, the last chunk 5 rows; 2 with 1 lane: R = 11 partials on one lane (stage 2's eight at
# a time and its tail). Each geometry in float32 and bf16.
@pytest.mark.parametrize("rows_per_block, lanes, bf16", [(21, 2, False), (21, 2, True), (8, 4, False),
                                                         (8, 4, True), (2, 1, False), (2, 1, True)])
def test_column_sum_pairs_kernel_gives_the_scalar_kernels_bits(fdev, rng, rows_per_block, lanes, bf16):
    N, C = 21, 70
    assert C % 2 == 0 and C % COLSUM_PAIR_STRIP != 0
    x = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))     # magnitudes apart: order shows
    start = rng.normal(size=C)
    x, start = (f32_to_bf16(x), f32_to_bf16(start)) if bf16 else (x.astype(np.float32), start.astype(np.float32))
    (out, partial, counters), (out_p, partial_p, counters_p) = launch_both(fdev, x, start, rows_per_block, lanes)
    # each column's adds in the same order: the same bits, out and every partial sum; the counters back at 0
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(partial_p, partial)
    assert not np.isnan(partial).any()
    np.testing.assert_array_equal(counters, 0)
    np.testing.assert_array_equal(counters_p, 0)
    # and the sums are right: float64 sums, one rounding to out's float32 (bf16: within one bf16 step)
    wide = (lambda a: bf16_to_f32(a)) if bf16 else (lambda a: a)
    np.testing.assert_allclose(wide(out_p), sums64(wide(start), wide(x)), rtol=2.0 ** -7 if bf16 else 1e-6,
                               atol=1e-30)


def test_pairs_fit_takes_contiguous_aligned_float32_and_bf16_rows_of_even_width():
    x32, x16 = np.zeros((4, 70), np.float32), np.zeros((4, 70), np.uint16)
    assert pairs_fit(x32) and pairs_fit(x16) and pairs_fit(x32, x16)
    assert not pairs_fit(np.zeros((4, 71), np.float32))              # odd C
    assert not pairs_fit(np.zeros((4, 70)))                          # float64
    assert not pairs_fit(x32[:, 1:69])                               # not contiguous
    assert not pairs_fit(x32.reshape(-1)[1:141].reshape(2, 70))      # starts mid-word
    assert not pairs_fit(x32, np.zeros((4, 70)))                     # every array must fit


# d12 at B=16, T=1024: the bias gradients' N and C (768: attention projection, fc projection; 2304: qkv)
@pytest.mark.gpu
@pytest.mark.parametrize("C", [768, 2304])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_column_sum_pairs_kernel_gives_the_scalar_kernels_bits_at_gpt2_size(fdev, rng, C, bf16):
    N = 16384
    x = rng.normal(size=(N, C))
    start = rng.normal(size=C)
    x, start = (f32_to_bf16(x), f32_to_bf16(start)) if bf16 else (x.astype(np.float32), start.astype(np.float32))
    (out, partial, _), (out_p, partial_p, counters_p) = launch_both(fdev, x, start, None)
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(partial_p, partial)
    np.testing.assert_array_equal(counters_p, 0)
    # the layer picks the paired kernel here; its time against the scalar kernel's
    xd = fdev.asarray(x)
    assert pairs_fit(xd)
    out = fdev.asarray(start)
    times = {}
    for kernel, pairs in ((column_sum_kernel, False), (column_sum_pairs_kernel, True)):
        grid, block, R, rows = colsum_geometry(fdev, N, C, None, pairs)
        partial, counters = fdev.zeros((R, C), np.float64), fdev.zeros(grid[0], np.int32)
        args = (out, partial, counters, pair_view(xd) if pairs else xd, rows)
        times[kernel.py_func.__name__] = gpu_ms_per_call(
            fdev, lambda kernel=kernel, grid=grid, block=block, args=args: fdev.launch(kernel, grid, block, *args))
    gbs = {k: N * C * x.itemsize / ms / 1e6 for k, ms in times.items()}
    print(f"column_sum {x.dtype} N={N} C={C}: paired == scalar bit for bit (out, all {R}x{C} partials); " + ", ".join(f"{k} {times[k]:.4f} ms ({gbs[k]:.0f} GB/s)" for k in times))


# x and out each float32 or bf16; (37,45): off the chunk, lane and strip grids; rows_per_block=5: a chunk
# that is not a multiple of the lanes
@pytest.mark.parametrize("x_bf16, out_bf16, rows_per_block", [(True, True, None), (True, True, 5),
                                                              (True, False, None), (False, True, None)])
def test_column_sum_kernel_on_bf16_is_within_one_rounding_of_the_teaching_kernel(fdev, rng, x_bf16, out_bf16,
                                                                                 rows_per_block):
    N, C_ = 37, 45
    x = rand_bf16(rng, (N, C_)) if x_bf16 else rng.normal(size=(N, C_)).astype(np.float32)
    start = rand_bf16(rng, C_) if out_bf16 else rng.normal(size=C_).astype(np.float32)
    out = fdev.asarray(start)                                         # accumulates: starts random
    column_sum(fdev, out, fdev.asarray(x), rows_per_block=rows_per_block)
    got, want = fdev.to_host(out), teaching_bias(fdev, start, x)
    if out_bf16:
        # the same float64 sum in another order, rounded once to bf16: within one bf16 step, 1e-4 absolute
        # where a column cancels to near zero
        assert_within_one_step(got, want, atol=1e-4)
    else:
        # float32 out: one float32 rounding of the float64 start + sum, the order apart
        assert ulps_apart(got, want).max() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("C", [768, 2304])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_column_sum_is_within_one_rounding_of_the_teaching_kernel_at_gpt2_size(kdev, fdev, rng, C, bf16):
    N = 16384
    x, start = (rand_bf16(rng, (N, C)), rand_bf16(rng, C)) if bf16 else \
        (rng.normal(size=(N, C)).astype(np.float32), rng.normal(size=C).astype(np.float32))
    out = fdev.asarray(start)
    column_sum(fdev, out, fdev.asarray(x))
    got, want = fdev.to_host(out), teaching_bias(kdev, start, x)
    apart = (lambda a, b: np.abs(a.astype(np.int64) - b)) if bf16 else ulps_apart
    print(f"column_sum {'bf16' if bf16 else 'float32'} N={N} C={C} vs the teaching bias kernel: "
          f"{np.mean(got == want):.4%} bit-identical, worst {apart(got, want).max()} ulp apart")
    if bf16:
        assert_within_one_step(got, want, atol=1e-3)
    else:
        assert ulps_apart(got, want).max() <= 1
