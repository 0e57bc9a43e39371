"""GELU: the kernel against the NumPy reference, the reference against finite differences."""
import numpy as np
import pytest

from helpers import finite_diff, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.gelu import (
    ELEMS_PER_THREAD,
    gelu_backward,
    gelu_backward_ref,
    gelu_forward,
    gelu_forward_ref,
)


def test_gelu_forward_kernel_matches_reference(kdev, rng):
    x = rng.normal(size=(3, 5, 7)).astype(np.float32) * 3       # 105 elements: not a multiple of the block
    out = poisoned(kdev, x.shape)
    gelu_forward(kdev, out, kdev.asarray(x))
    ref = np.empty_like(x, dtype=np.float64)
    gelu_forward_ref(ref, x.astype(np.float64))
    # float32 tanh and cubes: a few ulps per element
    assert rel_err(kdev.to_host(out), ref) < 1e-6


def test_gelu_backward_kernel_matches_reference_and_accumulates(kdev, rng):
    x = rng.normal(size=(105,)) * 3
    dout = rng.normal(size=x.shape)
    start = rng.normal(size=x.shape)                             # backward accumulates: start non-zero
    dinp = kdev.asarray(start, np.float32)
    gelu_backward(kdev, dinp, kdev.asarray(x, np.float32), kdev.asarray(dout, np.float32))
    ref = start.copy()
    gelu_backward_ref(ref, x, dout)
    assert rel_err(kdev.to_host(dinp), ref) < 1e-6


# each thread takes ELEMS_PER_THREAD = 4 elements a grid apart: in the simulator (32-thread blocks) 5 is less
# than one block, 300 is 3 blocks of 4 x 32 elements (384 slots) with a ragged tail, 4 x 32 + 1 one element
# past a full block
@pytest.mark.parametrize("n", [5, 300, ELEMS_PER_THREAD * 32 + 1])
def test_gelu_kernels_write_every_element_when_n_is_off_the_block_grid(kdev, rng, n):
    x = rng.normal(size=n) * 3
    out = poisoned(kdev, n)
    gelu_forward(kdev, out, kdev.asarray(x, np.float32))
    ref = np.empty(n)
    gelu_forward_ref(ref, x.astype(np.float32).astype(np.float64))
    # float32 tanh and cubes: a few ulps per element (a NaN left by a missed element fails)
    assert rel_err(kdev.to_host(out), ref) < 1e-6
    dout, start = rng.normal(size=n), rng.normal(size=n)
    dinp = kdev.asarray(start, np.float32)                        # accumulates: starts random
    gelu_backward(kdev, dinp, kdev.asarray(x, np.float32), kdev.asarray(dout, np.float32))
    want = start.astype(np.float32).astype(np.float64)
    gelu_backward_ref(want, x.astype(np.float32).astype(np.float64), dout.astype(np.float32).astype(np.float64))
    # a missed element keeps its start value: far off
    assert rel_err(kdev.to_host(dinp), want) < 1e-6


def test_gelu_reference_backward_matches_finite_differences(rng):
    x = rng.normal(size=(4, 6)) * 2
    dout = rng.normal(size=x.shape)

    def f(x):
        out = np.empty_like(x)
        gelu_forward_ref(out, x)
        return out
    dinp = np.zeros_like(x)
    gelu_backward_ref(dinp, x, dout)
    idx, g = finite_diff(f, x, dout)
    assert rel_err(dinp.reshape(-1)[idx], g) < 1e-6


def test_gelu_reference_on_bf16_storage_rounds_the_float32_reference(rng):
    # uint16 arrays hold bf16 bits: the reference computes in float32 and rounds its outputs to nearest
    x, dout, start = (f32_to_bf16(rng.normal(size=(4, 25)) * 2) for _ in range(3))
    x0, dout0 = x.copy(), dout.copy()
    out = np.full(x.shape, 0x7FC0, np.uint16)
    gelu_forward_ref(out, x)
    want = np.empty(x.shape, np.float32)
    gelu_forward_ref(want, bf16_to_f32(x))
    np.testing.assert_array_equal(out, f32_to_bf16(want))
    dinp = start.copy()
    gelu_backward_ref(dinp, x, dout)
    want = bf16_to_f32(start)
    gelu_backward_ref(want, bf16_to_f32(x), bf16_to_f32(dout))
    np.testing.assert_array_equal(dinp, f32_to_bf16(want))
    # inputs untouched
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(dout, dout0)
