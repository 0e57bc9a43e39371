"""Shared test helpers: poisoned outputs, relative errors, central finite differences."""
import numpy as np


def rel_err(a, b) -> float:
    """||a - b|| / ||b||, in float64; NaN anywhere makes it NaN, which fails every `<=` check."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def poisoned(dev, shape, dtype=None):
    """An output buffer on `dev` filled with NaN, so an element the kernel never writes fails the test."""
    return dev.full(shape, np.nan, dtype=dtype)


def host(dev, a):
    return dev.to_host(a)


def finite_diff(f, x: np.ndarray, dout: np.ndarray, eps: float = 1e-6, max_checks: int | None = None,
                rng=None) -> tuple[np.ndarray, np.ndarray]:
    """Central differences of L(x) = sum(f(x) * dout) with respect to x (float64).
    Returns (indices checked, derivative at those indices). f must return a new array."""
    flat = x.reshape(-1)
    idx = np.arange(flat.size)
    if max_checks is not None and flat.size > max_checks:
        idx = (rng or np.random.default_rng(0)).choice(flat.size, max_checks, replace=False)
    g = np.empty(idx.size)
    for k, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + eps
        lp = np.sum(f(x) * dout)
        flat[i] = old - eps
        lm = np.sum(f(x) * dout)
        flat[i] = old
        g[k] = (lp - lm) / (2 * eps)
    return idx, g


def gpu_ms_per_call(dev, call, reps=20) -> float:
    """Milliseconds per call of `call` (launches on dev's compute stream), timed with CUDA events after one
    warm-up call (which compiles)."""
    import cupy
    call()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(dev.compute_stream.cupy)
    for _ in range(reps):
        call()
    e1.record(dev.compute_stream.cupy)
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) / reps
