"""GELU: the kernel against the NumPy reference, the reference against finite differences."""
import numpy as np

from helpers import finite_diff, poisoned, rel_err
from llmz.kernels.gelu import gelu_backward, gelu_backward_ref, gelu_forward, gelu_forward_ref


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
