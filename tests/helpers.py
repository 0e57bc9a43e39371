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


# ---- bf16 storage (uint16 bits) and bit comparisons -------------------------------------------------------
NAN_BF16 = 0x7FC0                   # bf16's quiet NaN: the poison of a uint16 output
# bf16 keeps 8 significant bits: rounding to nearest moves a value by less than 2^-8 of it (half the spacing
# 2^-7 at the bottom of a binade)
REL_BF16 = 2.0 ** -8
STORAGES = ("float32", "bf16")


def poisoned_bf16(dev, shape):
    """A uint16 output filled with the bf16 NaN pattern: an element the kernel never writes fails."""
    return dev.full(shape, NAN_BF16, np.uint16)


def rand_bf16(rng, shape, scale=1.0) -> np.ndarray:
    """Random normal values rounded to bf16 bits (uint16)."""
    from llmz.bf16 import f32_to_bf16
    return f32_to_bf16(rng.normal(size=shape) * scale)


def rand_storage(rng, shape, storage, scale=1.0):
    """Random normal values as float32, or rounded to bf16 bits (uint16)."""
    return rng.normal(size=shape).astype(np.float32) * np.float32(scale) if storage == "float32" else \
        rand_bf16(rng, shape, scale)


def nan_storage(dev, shape, storage):
    """An output poisoned with NaN (the bf16 quiet NaN for uint16)."""
    return dev.full(shape, np.nan, np.float32) if storage == "float32" else poisoned_bf16(dev, shape)


def bits(a) -> np.ndarray:
    """Stored bits to compare bit for bit, NaN included (float32 as uint32, float64 as uint64; bf16 already
    bits)."""
    a = np.asarray(a)
    return a.view({4: np.uint32, 8: np.uint64}[a.itemsize]) if a.dtype.kind == "f" else a


def as_f64(a) -> np.ndarray:
    """Stored values as float64 (bf16 bits widened)."""
    from llmz.bf16 import bf16_to_f32
    a = np.asarray(a)
    return (bf16_to_f32(a) if a.dtype == np.uint16 else a).astype(np.float64)


def steps_apart(a, b) -> np.ndarray:
    """bf16 bits a, b -> how many representable bf16 values apart they are (+0 and -0 count as one value)."""
    def ordered(x):
        x = np.asarray(x, np.uint16).astype(np.int64)
        return np.where(x & 0x8000, -(x & 0x7FFF), x)
    return np.abs(ordered(a) - ordered(b))


def assert_within_one_step(got, want, atol=0.0):
    """uint16 bits: every element within one bf16 step of want, or within atol of it (a scalar or per element:
    where a sum cancels to near zero, the float32 rounding of its terms can move it more than a step of the
    small result)."""
    from llmz.bf16 import bf16_to_f32
    assert not np.any(np.isnan(bf16_to_f32(got))), "NaN in the output: an element was not written"
    far = (steps_apart(got, want) > 1) & (np.abs(bf16_to_f32(got) - bf16_to_f32(want)) > atol)
    assert not far.any(), f"{far.sum()} elements more than one bf16 step off, e.g. {bf16_to_f32(got)[far][:5]}" \
                          f" vs {bf16_to_f32(want)[far][:5]}"


def assert_rounded_float32(name, got_bits, want32, rel=REL_BF16):
    """The bf16 run of a kernel against its float32 run on the same (widened) values: within rel per element;
    prints the worst error and the share bit-identical to round_to_nearest(float32 result)."""
    from llmz.bf16 import bf16_to_f32, f32_to_bf16
    got, want = bf16_to_f32(got_bits).astype(np.float64), want32.astype(np.float64)
    err = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    same = np.mean(got_bits == f32_to_bf16(want32))
    print(f"{name}: worst relative error per element {err.max():.3e} (bound {rel:.3e}); "
          f"{same:.4%} bit-identical to round_to_nearest(float32 kernel)")
    assert err.max() <= rel


def ulps_apart(a, b) -> np.ndarray:
    """float32 arrays a, b -> how many float32 values apart each pair is (sign-aware)."""
    def ordered(x):
        x = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(x < 0, -(x & 0x7FFFFFFF), x)
    return np.abs(ordered(a) - ordered(b))
