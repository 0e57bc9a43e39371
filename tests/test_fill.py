"""Fill and zero (llmz/kernels/fill.py, the teaching kernel: one thread per element), on float and bf16 buffers;
the fast zero (llmz/fast/fill.py: one memset) gives the same bits."""
import numpy as np
import pytest

from helpers import NAN_BF16
from llmz.bf16 import f32_to_bf16
from llmz.fast.fill import zero as fast_zero
from llmz.kernels.fill import fill, fill_ref, zero


def poison(n):
    return np.full(n, NAN_BF16, np.uint16)


@pytest.mark.parametrize("value", [0.1, -3.0, 0.0, 1e-30])
def test_fill_kernel_on_bf16_stores_the_rounded_bits_of_value(kdev, value):
    x = kdev.asarray(poison(37))
    fill(kdev, x, value)
    ref = poison(37)
    fill_ref(ref, value)
    want = f32_to_bf16(np.float32(value))
    assert np.all(kdev.to_host(x) == want) and np.all(ref == want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fill_kernel_writes_every_element(kdev, dtype):
    x = kdev.full(37, np.nan, dtype)                    # past the simulator's 32-thread block
    fill(kdev, x, 2.5)
    np.testing.assert_array_equal(kdev.to_host(x), np.full(37, 2.5, dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_fast_zero_is_the_teaching_zero_bit_for_bit(kdev, fdev, dtype):
    got = {}
    for name, dev, z in (("teaching", kdev, zero), ("fast", fdev, fast_zero)):
        x = dev.asarray(poison(40).astype(dtype) if dtype == np.uint16 else np.full(40, -1.5, dtype))
        z(dev, x)                                       # the fast one: a memset
        got[name] = dev.to_host(x)
    np.testing.assert_array_equal(got["fast"].view(np.uint8), got["teaching"].view(np.uint8))
    assert not got["fast"].view(np.uint8).any()          # all-zero bits: +0.0 (and bf16 +0)
