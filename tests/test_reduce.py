"""Column sums: the two-stage kernel against the NumPy reference; deterministic; sizes off the chunk grid;
stage 2 in each strip's last block whichever block that is (the simulator's block order changed), the block
counters left at zero."""
import sys
import threading
import time

import numba
import numpy as np
import pytest
from numba import cuda

from helpers import gpu_ms_per_call, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.device import ceil_div
from llmz.kernels import reduce
from llmz.kernels.bf16 import pair_view
from llmz.kernels.reduce import (
    COLSUM_PAIR_STRIP,
    colsum_geometry,
    column_sum,
    column_sum_kernel,
    column_sum_pairs_kernel,
    column_sum_ref,
    pairs_fit,
)


@pytest.fixture(autouse=True)
def quick_barriers():
    """The simulator's block manager busy-polls for every syncthreads: switching Python threads every 50 us
    instead of every 5 ms makes the kernels' barriers (5 a block here) several times faster."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    yield
    sys.setswitchinterval(interval)


def test_column_sum_reference_matches_plain_sums(rng):
    x = rng.normal(size=(3, 7, 5)).astype(np.float32)
    start = rng.normal(size=5).astype(np.float32)
    out = start.copy()
    column_sum_ref(out, x)
    assert out.dtype == np.float32
    want = start.astype(np.float64) + np.array([sum(float(v) for v in x[..., c].ravel()) for c in range(5)])
    # one float32 rounding of a float64 sum
    assert rel_err(out, want) < 1e-7
    column_sum_ref(out, x, accumulate=False)
    assert rel_err(out, want - start) < 1e-7


def test_column_sum_reference_on_bf16_storage_rounds_the_float64_sums(rng):
    # uint16 x and out hold bf16 bits: sums in float64 of the exact values, added to out's value and rounded
    # (to float32, then to nearest bf16: the kernel's store)
    x = f32_to_bf16(rng.normal(size=(3, 7, 5)))
    start = f32_to_bf16(rng.normal(size=5))
    s = bf16_to_f32(x).reshape(-1, 5).sum(axis=0, dtype=np.float64)
    out = start.copy()
    column_sum_ref(out, x)
    np.testing.assert_array_equal(out, f32_to_bf16(bf16_to_f32(start) + s))
    column_sum_ref(out, x, accumulate=False)
    np.testing.assert_array_equal(out, f32_to_bf16(s))


# (37,45): N not a multiple of the chunk (8 rows in the simulator) nor of the lanes (4), C of the 32-column
# strip; (3,5): fewer rows than one chunk, fewer columns than one strip; rows_per_block=5: chunk not a
# multiple of the lanes; (0,7): no rows at all
@pytest.mark.parametrize("shape, rows_per_block", [((37, 45), None), ((3, 5), None), ((37, 45), 5),
                                                   ((0, 7), None)])
def test_column_sum_kernel_matches_reference_and_accumulates(kdev, rng, shape, rows_per_block):
    C = shape[1]
    x = rng.normal(size=shape).astype(np.float32)
    start = rng.normal(size=C)                       # accumulates: start from random non-zero values
    out = kdev.asarray(start, np.float32)
    column_sum(kdev, out, kdev.asarray(x), rows_per_block=rows_per_block)
    want = start.copy()
    column_sum_ref(want, x.astype(np.float64))
    # float64 sums of float32 inputs, one float32 rounding of start + sum: an ulp or so
    assert rel_err(kdev.to_host(out), want) < 1e-6


def test_column_sum_kernel_overwrites_poisoned_output(kdev, rng):
    x = rng.normal(size=(37, 45)).astype(np.float32)
    out = poisoned(kdev, (45,))
    column_sum(kdev, out, kdev.asarray(x), accumulate=False)
    want = np.zeros(45)
    column_sum_ref(want, x.astype(np.float64))
    assert rel_err(kdev.to_host(out), want) < 1e-6


def test_column_sum_kernel_float64_input_and_3d_rows(kdev, rng):
    x = rng.normal(size=(3, 11, 40))
    start = rng.normal(size=40)
    out = kdev.asarray(start)
    column_sum(kdev, out, kdev.asarray(x))
    want = start.copy()
    column_sum_ref(want, x)
    # float64 throughout, only the summation order differs
    assert rel_err(kdev.to_host(out), want) < 1e-14


def test_column_sum_kernel_gives_the_same_bits_twice(kdev, rng):
    x = kdev.asarray(rng.normal(size=(37, 45)).astype(np.float32) * 1e3)
    start = rng.normal(size=45).astype(np.float32)
    got = []
    for _ in range(2):
        out = kdev.asarray(start)
        column_sum(kdev, out, x)
        got.append(kdev.to_host(out))
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
def test_column_sum_kernel_adds_in_the_documented_fixed_order(kdev, rng, rows_per_block):
    N, C = 37, 20
    x = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))   # magnitudes apart: order shows
    start = rng.normal(size=C)
    out = kdev.asarray(start)
    column_sum(kdev, out, kdev.asarray(x), rows_per_block=rows_per_block)
    # the model: stage 1 per chunk, stage 2 over the partials, both in lanes (float64 throughout)
    _, block, R, rows = colsum_geometry(kdev, N, C, rows_per_block)
    lanes = block[1]
    partial = np.stack([lanes_model(x, y * rows, min((y + 1) * rows, N), lanes) for y in range(R)])
    want = start + lanes_model(partial, 0, R, lanes)
    # float64 adds in the same order: the same bits
    np.testing.assert_array_equal(kdev.to_host(out), want)


# rows_per_block 8 (the simulator's chunk): R = 5, the last chunk 5 rows; 64: R = 1, the only block is the last
@pytest.mark.parametrize("rows_per_block", [8, 64])
def test_column_sum_kernel_twice_in_a_row_is_right_and_leaves_the_counters_zero(kdev, rng, rows_per_block):
    N, C = 37, 45                                    # two strips, the second 13 columns wide
    grid, block, R, rows = colsum_geometry(kdev, N, C, rows_per_block)
    assert R == ceil_div(N, rows_per_block) and grid[0] == 2
    partial = poisoned(kdev, (R, C), np.float64)
    counters = kdev.zeros(grid[0], np.int32)
    # the second launch (other x, overwriting a poisoned out) counts from the zero the first one left
    for accumulate in (True, False):
        x = rng.normal(size=(N, C))
        start = rng.normal(size=C) if accumulate else np.full(C, np.nan)
        out = kdev.asarray(start)
        kdev.launch(column_sum_kernel, grid, block, out, partial, counters, kdev.asarray(x), rows, accumulate)
        want = start.copy() if accumulate else np.zeros(C)
        column_sum_ref(want, x)
        # float64 throughout, only the summation order differs
        assert rel_err(kdev.to_host(out), want) < 1e-14
        np.testing.assert_array_equal(kdev.to_host(counters), 0)


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
    last_in_strip = reduce.last_in_strip

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
def test_column_sum_kernel_bits_do_not_depend_on_which_block_finishes_last(kdev, rng, monkeypatch):
    if kdev.kind != "sim":
        pytest.skip("changes the simulator's block order")
    N, C = 37, 45
    x = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))   # magnitudes apart: order shows
    start = rng.normal(size=C)
    grid, block, R, rows = colsum_geometry(kdev, N, C)
    got, lasts = {}, {}
    for order in ("grid", "reversed", "shuffled"):
        monkeypatch.undo()
        lasts[order] = run_blocks_in_order(monkeypatch, order, rng, [reduce])
        out = kdev.asarray(start)
        column_sum(kdev, out, kdev.asarray(x))
        got[order] = kdev.to_host(out)
    assert sorted(lasts["grid"]) == [(0, R - 1), (1, R - 1)]
    assert sorted(lasts["reversed"]) == [(0, 0), (1, 0)]
    assert len(lasts["shuffled"]) == 2
    partial = np.stack([lanes_model(x, y * rows, min((y + 1) * rows, N), block[1]) for y in range(R)])
    want = start + lanes_model(partial, 0, R, block[1])
    for bits in got.values():
        np.testing.assert_array_equal(bits, want)
    np.testing.assert_array_equal(kdev.to_host(kdev.scratch("colsum_count", grid[0], np.int32)), 0)


def test_colsum_geometry_covers_every_row_and_column(kdev):
    grid, block, R, rows = colsum_geometry(kdev, 37, 45)
    assert grid[0] * block[0] >= 45 and grid[1] == R and R * rows >= 37 > (R - 1) * rows


@pytest.mark.gpu
def test_column_sum_kernel_matches_float64_reference_at_gpt2_size(kdev, rng):
    N, C = 16384, 768
    x = rng.normal(size=(N, C)).astype(np.float32)
    start = rng.normal(size=C).astype(np.float32)
    want = start.astype(np.float64)
    column_sum_ref(want, x.astype(np.float64))
    xd = kdev.asarray(x)
    out = kdev.asarray(start)
    column_sum(kdev, out, xd)
    err = rel_err(kdev.to_host(out), want)
    # timing: the same launches again, after compilation
    reps = 20
    kdev.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        column_sum(kdev, out, xd, accumulate=False)
    kdev.synchronize()
    ms = (time.perf_counter() - t0) / reps * 1e3
    print(f"column_sum N={N} C={C}: worst relative error {err:.2e}, {ms:.3f} ms per call (1 launch)")
    # float64 sums of 16384 float32 values, one float32 rounding at the end
    assert err < 1e-6


# ---- the paired kernel: words of two columns, the same bits as column_sum_kernel --------------------------
def launch_both(dev, x, start, accumulate, rows_per_block, lanes=None):
    """column_sum_kernel and column_sum_pairs_kernel on the same x (N,C) and out start (accumulate False: a
    NaN start), the same rows_per_block and lanes (None: the device's). Returns ((out, partial, counters) of the
    scalar kernel, the same of the paired one), on the host."""
    N, C = x.shape
    runs = []
    for kernel, pairs in ((column_sum_kernel, False), (column_sum_pairs_kernel, True)):
        grid, block, R, rows = colsum_geometry(dev, N, C, rows_per_block, pairs)
        block = (block[0], lanes or block[1])
        out = dev.asarray(start)
        partial = poisoned(dev, (R, C), np.float64)
        counters = dev.zeros(grid[0], np.int32)
        xd = dev.asarray(x)
        dev.launch(kernel, grid, block, out, partial, counters, pair_view(xd) if pairs else xd, rows, accumulate)
        runs.append([dev.to_host(a) for a in (out, partial, counters)])
    return runs


# C = 70: a full 64-column strip and one of 6 (3 words), 3 strips of 32 for the scalar kernel. N = 21 rows:
# rows_per_block 21 with 2 lanes: R = 1, 10 or 11 rows a lane (stage 1's eight loads at a time and its tail);
# 8 with 4 lanes: R = 3, the last chunk 5 rows; 2 with 1 lane: R = 11 partials on one lane (stage 2's eight at
# a time and its tail). Each geometry in float32 and bf16, accumulating in one, overwriting in the other.
@pytest.mark.parametrize("rows_per_block, lanes, bf16, accumulate", [
    (21, 2, False, True), (21, 2, True, False), (8, 4, False, False), (8, 4, True, True), (2, 1, False, True),
    (2, 1, True, False)])
def test_column_sum_pairs_kernel_gives_the_scalar_kernels_bits(kdev, rng, rows_per_block, lanes, bf16,
                                                               accumulate):
    N, C = 21, 70
    assert C % 2 == 0 and C % COLSUM_PAIR_STRIP != 0
    x = rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))     # magnitudes apart: order shows
    start = rng.normal(size=C) if accumulate else np.full(C, np.nan)       # overwriting: a NaN start
    x, start = (f32_to_bf16(x), f32_to_bf16(start)) if bf16 else (x.astype(np.float32), start.astype(np.float32))
    (out, partial, counters), (out_p, partial_p, counters_p) = launch_both(kdev, x, start, accumulate,
                                                                          rows_per_block, lanes)
    # each column's adds in the same order: the same bits, out and every partial sum; the counters back at 0
    np.testing.assert_array_equal(out_p, out)
    np.testing.assert_array_equal(partial_p, partial)
    assert not np.isnan(partial).any()
    np.testing.assert_array_equal(counters, 0)
    np.testing.assert_array_equal(counters_p, 0)
    # and the sums are right: float64 sums, one rounding to out's float32 (bf16: within one bf16 step)
    want = start.copy()
    column_sum_ref(want, x, accumulate=accumulate)
    got, want = (bf16_to_f32(out_p), bf16_to_f32(want)) if bf16 else (out_p, want)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7 if bf16 else 1e-6, atol=1e-30)


def test_pairs_fit_takes_contiguous_aligned_float32_and_bf16_rows_of_even_width():
    from types import SimpleNamespace
    gpu, sim = SimpleNamespace(kind="gpu"), SimpleNamespace(kind="sim")
    x32, x16 = np.zeros((4, 70), np.float32), np.zeros((4, 70), np.uint16)
    assert pairs_fit(gpu, x32) and pairs_fit(gpu, x16) and pairs_fit(gpu, x32, x16)
    assert not pairs_fit(sim, x32)                                   # the simulator keeps the scalar kernels
    assert not pairs_fit(gpu, np.zeros((4, 71), np.float32))         # odd C
    assert not pairs_fit(gpu, np.zeros((4, 70)))                     # float64
    assert not pairs_fit(gpu, x32[:, 1:69])                          # not contiguous
    assert not pairs_fit(gpu, x32.reshape(-1)[1:141].reshape(2, 70))  # starts mid-word
    assert not pairs_fit(gpu, x32, np.zeros((4, 70)))               # every array must fit


# d12 at B=16, T=1024: the bias gradients' N and C (768: attention projection, fc projection; 2304: qkv)
@pytest.mark.gpu
@pytest.mark.parametrize("C", [768, 2304])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_column_sum_pairs_kernel_gives_the_scalar_kernels_bits_at_gpt2_size(kdev, rng, C, bf16):
    N = 16384
    x = rng.normal(size=(N, C))
    start = rng.normal(size=C)
    x, start = (f32_to_bf16(x), f32_to_bf16(start)) if bf16 else (x.astype(np.float32), start.astype(np.float32))
    for accumulate in (True, False):
        (out, partial, _), (out_p, partial_p, counters_p) = launch_both(
            kdev, x, start if accumulate else np.full(C, np.nan, start.dtype), accumulate, None)
        np.testing.assert_array_equal(out_p, out)
        np.testing.assert_array_equal(partial_p, partial)
        np.testing.assert_array_equal(counters_p, 0)
    # the layer picks the paired kernel here; its time against the scalar kernel's
    xd = kdev.asarray(x)
    assert pairs_fit(kdev, xd)
    out = kdev.asarray(start)
    times = {}
    for kernel, pairs in ((column_sum_kernel, False), (column_sum_pairs_kernel, True)):
        grid, block, R, rows = colsum_geometry(kdev, N, C, None, pairs)
        partial, counters = kdev.zeros((R, C), np.float64), kdev.zeros(grid[0], np.int32)
        args = (out, partial, counters, pair_view(xd) if pairs else xd, rows, True)
        times[kernel.py_func.__name__] = gpu_ms_per_call(
            kdev, lambda kernel=kernel, grid=grid, block=block, args=args: kdev.launch(kernel, grid, block, *args))
    gbs = {k: N * C * x.itemsize / ms / 1e6 for k, ms in times.items()}
    print(f"column_sum {x.dtype} N={N} C={C}: paired == scalar bit for bit (out, all {R}x{C} partials, "
          f"accumulate and overwrite); " + ", ".join(f"{k} {times[k]:.4f} ms ({gbs[k]:.0f} GB/s)" for k in times))



@cuda.jit
def shared_relay_kernel(out):
    # out (32,): thread i writes i through four shared arrays, each allocated right after a barrier that
    # releases all 32 threads towards its line at once; one array per block gives out[i] = i
    i = cuda.threadIdx.x
    cuda.syncthreads()
    a = cuda.shared.array(32, numba.int64)
    a[i] = i
    cuda.syncthreads()
    b = cuda.shared.array(32, numba.int64)
    b[i] = a[31 - i]
    cuda.syncthreads()
    c = cuda.shared.array(32, numba.int64)
    c[i] = b[31 - i]
    cuda.syncthreads()
    d = cuda.shared.array(32, numba.int64)
    d[i] = c[(i + 1) % 32]
    cuda.syncthreads()
    out[i] = d[(i + 31) % 32]


def test_simulator_shared_arrays_are_one_per_block_under_thread_switches(kdev):
    # Numba's simulator made a block's shared array unlocked (get, else create and store), so threads
    # reaching the line together could each get their own: a column sum then lost lanes (seen 1 run in ~10).
    # Device("sim") installs a locked allocation (llmz.device._thread_safe_simulator_shared). Measured with
    # the simulator as shipped: 29 and 34 of these 100 launches wrong; with the lock, none.
    if kdev.kind != "sim":
        pytest.skip("the simulator's shared arrays")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        wrong = 0
        for _ in range(100):
            out = np.full(32, -1, np.int64)
            shared_relay_kernel[1, 32](out)
            wrong += not np.array_equal(out, np.arange(32))
    finally:
        sys.setswitchinterval(interval)
    assert wrong == 0, f"{wrong} of 100 launches saw more than one shared array per block"
