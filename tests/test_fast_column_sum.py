"""The one-launch column sums (llmz/fast/column_sum.py: units of 8 columns, 256-column strips, two stages in one
launch) against float64 sums and the teaching bias kernel (llmz/kernels/matmul.py), in the documented fixed
order, whichever block of a strip finishes last; widths not a multiple of 8 and float64 take the teaching
kernel."""
import sys
import threading

import numpy as np
import pytest

from helpers import assert_within_one_step, poisoned, rand_bf16, rel_err, ulps_apart
from llmz.device import ceil_div
from llmz.fast import column_sum as colsum
from llmz.fast.column_sum import colsum_geometry, column_sum, column_sum_into
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



# (37,48): N not a multiple of the chunk nor of the lanes, 6 units (one partial strip); (3,8): fewer rows than
# the lanes, one unit; rows_per_block=5: a chunk not a multiple of the lanes; (0,16): no rows at all;
# (70,520): three strips, the last 2 units wide, R = 2 chunks of >= 64 rows
@pytest.mark.parametrize("shape, rows_per_block", [((37, 48), None), ((3, 8), None), ((37, 48), 5),
                                                   ((0, 16), None), ((70, 520), None)])
def test_column_sum_matches_float64_sums_and_the_teaching_kernel(fdev, rng, shape, rows_per_block):
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


# C = 45 (not a multiple of 8) and float64 x (3-D rows) take the teaching kernel: right all the same
@pytest.mark.parametrize("shape, dtype", [((37, 45), np.float32), ((3, 11, 40), np.float64)])
def test_column_sum_takes_the_teaching_kernel_where_units_do_not_fit(fdev, rng, launched, shape, dtype):
    x = rng.normal(size=shape).astype(dtype)
    start = rng.normal(size=shape[-1]).astype(dtype)
    out = fdev.asarray(start)
    names = launched(fdev)
    column_sum(fdev, out, fdev.asarray(x))
    assert names == ["matmul_backward_bias_kernel"]
    assert rel_err(fdev.to_host(out), sums64(start, x)) < (1e-14 if dtype == np.float64 else 1e-6)


def test_column_sum_gives_the_same_bits_twice_and_leaves_the_counters_zero(fdev, rng):
    N, C = 37, 264                                  # two strips, the second one unit wide
    x = fdev.asarray(rng.normal(size=(N, C)).astype(np.float32) * 1e3)
    start = rng.normal(size=C).astype(np.float32)
    grid, _, _, _ = colsum_geometry(fdev, N, C)
    got = []
    for _ in range(2):
        out = fdev.asarray(start)
        column_sum(fdev, out, x)
        got.append(fdev.to_host(out))
        np.testing.assert_array_equal(fdev.to_host(fdev.scratch("colsum_count", grid[0], np.int32)), 0)
    np.testing.assert_array_equal(got[0], got[1])


# rows_per_block 37 (one chunk): 18 or 19 rows a lane (2 lanes in the simulator): batches of 4 and a tail;
# rows_per_block 1: 37 partials, stage 2 over 18 or 19 a lane
@pytest.mark.parametrize("rows_per_block", [37, 1])
def test_column_sum_adds_in_the_documented_fixed_order(fdev, rng, rows_per_block):
    N, C = 37, 24
    x = (rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))).astype(np.float32)  # order shows
    start = rng.normal(size=C).astype(np.float32)
    out = fdev.asarray(start)
    column_sum(fdev, out, fdev.asarray(x), rows_per_block=rows_per_block)
    # the model: stage 1 per chunk, stage 2 over the partials, both in lanes (float64), one float32 rounding
    _, block, R, rows = colsum_geometry(fdev, N, C, rows_per_block)
    x64 = x.astype(np.float64)
    partial = np.stack([lanes_model(x64, y * rows, min((y + 1) * rows, N), block[1]) for y in range(R)])
    want = (start.astype(np.float64) + lanes_model(partial, 0, R, block[1])).astype(np.float32)
    np.testing.assert_array_equal(fdev.to_host(out), want)


# (37,264) in chunks of 8 rows, two strips: the last block of each strip is the last chunk in grid order, chunk
# 0 in reversed order, any chunk shuffled; the same bits, the documented order's (the simulator runs blocks one
# at a time: what is shown is that the result does not depend on which block counts last)
def test_column_sum_bits_do_not_depend_on_which_block_finishes_last(fdev, rng, monkeypatch):
    if fdev.kind != "sim":
        pytest.skip("changes the simulator's block order")
    N, C, rows = 37, 264, 8
    x = (rng.normal(size=(N, C)) * 10 ** rng.uniform(-3, 3, size=(N, 1))).astype(np.float32)
    start = rng.normal(size=C).astype(np.float32)
    _, block, R, _ = colsum_geometry(fdev, N, C, rows)
    got, lasts = {}, {}
    for order in ("grid", "reversed", "shuffled"):
        monkeypatch.undo()
        lasts[order] = run_blocks_in_order(monkeypatch, order, rng, [colsum])
        out = fdev.asarray(start)
        column_sum(fdev, out, fdev.asarray(x), rows_per_block=rows)
        got[order] = fdev.to_host(out)
    assert sorted(lasts["grid"]) == [(0, R - 1), (1, R - 1)]
    assert sorted(lasts["reversed"]) == [(0, 0), (1, 0)]
    assert len(lasts["shuffled"]) == 2
    x64 = x.astype(np.float64)
    partial = np.stack([lanes_model(x64, y * rows, min((y + 1) * rows, N), block[1]) for y in range(R)])
    want = (start.astype(np.float64) + lanes_model(partial, 0, R, block[1])).astype(np.float32)
    for bits in got.values():
        np.testing.assert_array_equal(bits, want)


def test_colsum_geometry_covers_every_row_and_column(fdev):
    for N, C in ((37, 48), (16384, 2304), (8192, 6400), (5, 8)):
        grid, block, R, rows = colsum_geometry(fdev, N, C)
        assert grid[0] * block[0] * 8 >= C and grid[1] == R and R * rows >= N > (R - 1) * rows
        assert R <= colsum.MAX_CHUNKS


def test_column_sum_into_splits_the_columns_between_two_outputs(fdev, rng):
    # layernorm's (G, 2C) partials: columns < C into dweight, the rest into dbias
    G, C = 21, 40
    x = rng.normal(size=(G, 2 * C)).astype(np.float32)
    starts = [rng.normal(size=C).astype(np.float32) for _ in range(2)]
    lo, hi = (fdev.asarray(s) for s in starts)
    column_sum_into(fdev, lo, hi, fdev.asarray(x))
    want = sums64(np.concatenate(starts), x)
    assert rel_err(fdev.to_host(lo), want[:C]) < 1e-6 and rel_err(fdev.to_host(hi), want[C:]) < 1e-6


@pytest.mark.parametrize("x_bf16, out_bf16, rows_per_block", [(True, True, None), (True, True, 5),
                                                              (True, False, None), (False, True, None)])
def test_column_sum_on_bf16_is_within_one_rounding_of_the_teaching_kernel(fdev, rng, x_bf16, out_bf16,
                                                                          rows_per_block):
    N, C_ = 37, 48
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
        assert ulps_apart(got, want).max() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("N, C", [(16384, 768), (16384, 2304), (8192, 6400), (8192, 1600)])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_column_sum_is_within_one_rounding_of_the_teaching_kernel_at_gpt2_size(kdev, fdev, rng, N, C, bf16):
    x, start = (rand_bf16(rng, (N, C)), rand_bf16(rng, C)) if bf16 else \
        (rng.normal(size=(N, C)).astype(np.float32), rng.normal(size=C).astype(np.float32))
    xd = fdev.asarray(x)
    got = []
    for _ in range(2):                               # the same bits twice
        out = poisoned(fdev, C, np.uint16 if bf16 else np.float32)
        out[...] = fdev.asarray(start)
        column_sum(fdev, out, xd)
        got.append(fdev.to_host(out))
    np.testing.assert_array_equal(got[0], got[1])
    want = teaching_bias(kdev, start, x)
    apart = (lambda a, b: np.abs(a.astype(np.int64) - b)) if bf16 else ulps_apart
    print(f"column_sum {'bf16' if bf16 else 'float32'} N={N} C={C} vs the teaching bias kernel: "
          f"{np.mean(got[0] == want):.4%} bit-identical, worst {apart(got[0], want).max()} ulp apart")
    if bf16:
        assert_within_one_step(got[0], want, atol=1e-3)
    else:
        assert ulps_apart(got[0], want).max() <= 1
