"""bfloat16 stored as uint16 bits (llmz/bf16.py and llmz/kernels/bf16.py): the conversion kernels against the
NumPy reference bit for bit (NaN, inf, zeros, subnormals, ties and overflow included); the element accessors
(load / store / store_add) every kernel reads and writes through; stochastic rounding unbiased and
reproducible; small gradients lost by round-to-nearest accumulation and kept by stochastic rounding. Each
kernel's bf16 storage is tested in its layer's file (tests/test_<layer>.py)."""
import numpy as np
import pytest
from numba import cuda

from helpers import NAN_BF16, poisoned_bf16, rand_bf16
from llmz.bf16 import bf16_to_f32, f32_to_bf16, f32_to_bf16_stochastic, random_u32, run_in_f32
from llmz.kernels.accumulate import accumulate_shard_bf16, accumulate_shard_bf16_ref
from llmz.kernels.bf16 import from_bf16, load, store, store_add, to_bf16

SEED = 1234

# float32 bit patterns where bf16 rounding goes wrong first, with their round-to-nearest-even result
# (written out by hand: these check the reference itself)
SPECIAL = {
    0x7FC00000: None, 0xFFC00000: None,            # quiet NaN, both signs: stays NaN (checked apart)
    0x7F800001: None, 0xFF80FFFF: None,            # NaN with payload only in the dropped bits: not inf
    0x7FFFFFFF: None,                              # NaN with every bit set: no carry into the sign
    0x7F800000: 0x7F80, 0xFF800000: 0xFF80,        # +-inf
    0x00000000: 0x0000, 0x80000000: 0x8000,        # +-0
    0x00000001: 0x0000, 0x0000FFFF: 0x0001,        # float32 subnormals, below and above half a bf16 step
    0x00008000: 0x0000, 0x00018000: 0x0002,        # subnormal ties: to even (down, up)
    0x007FFFFF: 0x0080,                            # largest subnormal rounds up to the smallest normal
    0x807FFFFF: 0x8080,
    0x3F808000: 0x3F80, 0x3F818000: 0x3F82,        # 1 + 2^-8 and 1 + 3 2^-8: ties to even (down, up)
    0x3F807FFF: 0x3F80, 0x3F808001: 0x3F81,        # just below and just above a tie
    0x7F7F0000: 0x7F7F,                            # bf16's largest finite value
    0x7F7F7FFF: 0x7F7F,                            # just below the overflow midpoint: stays finite
    0x7F7F8000: 0x7F80,                            # the overflow tie (0x7F7F is odd): rounds to inf
    0x7F7FFFFF: 0x7F80, 0xFF7FFFFF: 0xFF80,        # float32's +-max: beyond bf16's range, +-inf
}


def f32_of_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def sample_values(rng, n=1000) -> np.ndarray:
    """float32 values over the whole range: random magnitudes, random bit patterns (NaNs among them) and
    the special patterns; n + len(SPECIAL) elements, not a multiple of the block size."""
    with np.errstate(over="ignore"):
        mags = (rng.normal(size=n // 2) * np.exp(rng.uniform(-100, 89, n // 2))).astype(np.float32)
    bits = rng.integers(0, 2**32, n - n // 2, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([mags, f32_of_bits(bits), f32_of_bits(list(SPECIAL))])



def poison_u16(dev, shape):
    """A signalling-NaN pattern none of the conversions ever writes: an unwritten element fails."""
    return dev.asarray(np.full(shape, 0xFFBF, np.uint16))


def poison_f32(dev, shape):
    """A NaN with bits in the low half, which a bf16 value never has: an unwritten element fails."""
    return dev.asarray(np.full(shape, 0x7FC01234, np.uint32).view(np.float32))


def bits_of(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


# ---- the reference on the special patterns --------------------------------------------------------------
def test_nearest_reference_rounds_the_special_patterns_as_ieee_does():
    x = f32_of_bits(list(SPECIAL))
    b = f32_to_bf16(x)
    assert b.dtype == np.uint16
    for xb, want, got in zip(SPECIAL, SPECIAL.values(), b):
        if want is None:
            assert np.isnan(bf16_to_f32(got)) and got & 0x0040, f"{xb:#010x} -> {got:#06x}: not a quiet NaN"
            assert got >> 15 == xb >> 31, f"{xb:#010x} -> {got:#06x}: NaN lost its sign"
        else:
            assert got == want, f"{xb:#010x} -> {got:#06x}, expected {want:#06x}"


def test_every_bf16_value_survives_both_roundings_unchanged():
    b = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = bf16_to_f32(b)
    assert np.array_equal(bits_of(x), b.astype(np.uint32) << 16)          # bf16 -> f32 is exact
    keep = ~np.isnan(x)                                                   # NaNs become the quiet NaN
    assert np.array_equal(f32_to_bf16(x)[keep], b[keep])
    # nothing dropped, so nothing to round up, whatever the random bits
    assert np.array_equal(f32_to_bf16_stochastic(x, SEED, 3)[keep], b[keep])


def test_nearest_reference_matches_ml_dtypes_where_installed(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = sample_values(rng, 20000)
    nan = np.isnan(x)
    # NaNs are compared to ml_dtypes by being NaN only: casting a signalling NaN raises IEEE's invalid-operation
    # flag (NumPy's "invalid value encountered in cast"), so only the numbers go through ml_dtypes
    ours, theirs = f32_to_bf16(x), x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(ours[~nan], theirs)
    assert np.all(np.isnan(bf16_to_f32(ours[nan])))


def test_stochastic_reference_picks_a_neighbour_and_keeps_inf_and_nan(rng):
    x = sample_values(rng, 20000)
    b = f32_to_bf16_stochastic(x, SEED, 7).astype(np.int64)
    down = (bits_of(x) >> 16).astype(np.int64)                            # truncation: toward zero
    nan, inf = np.isnan(x), np.isinf(x)
    fin = ~nan & ~inf
    # a finite value becomes its lower or its upper bf16 neighbour (the upper one may be inf)
    assert np.all((b[fin] == down[fin]) | (b[fin] == down[fin] + 1))
    assert not np.any(np.isnan(bf16_to_f32(b[fin].astype(np.uint16))))
    assert np.array_equal(b[inf], down[inf])                               # inf stays inf
    assert np.all(np.isnan(bf16_to_f32(b[nan].astype(np.uint16))))       # NaN stays NaN, never inf
    # exact zeros (no dropped bits) stay exactly themselves, sign included
    z = f32_of_bits([0, 0x80000000] * 50)
    assert np.array_equal(f32_to_bf16_stochastic(z, SEED, 0), np.array([0, 0x8000] * 50, np.uint16))


# ---- the kernels against the reference, bit for bit --------------------------------------------------
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_to_bf16_kernel_matches_reference_bit_for_bit(kdev, rng, mode):
    x = sample_values(rng)
    out = poison_u16(kdev, x.shape)
    to_bf16(kdev, out, kdev.asarray(x), mode, seed=SEED, step=5, offset=17)
    want = f32_to_bf16_stochastic(x, SEED, 5, offset=17) if mode == "stochastic" else f32_to_bf16(x)
    assert np.array_equal(kdev.to_host(out), want)                        # integer arithmetic: exact


def test_to_bf16_kernel_keeps_the_shape_and_writes_every_element(kdev, rng):
    x = rng.normal(size=(3, 7, 5)).astype(np.float32)                     # 105 elements
    out = poison_u16(kdev, x.shape)
    to_bf16(kdev, out, kdev.asarray(x), "stochastic", seed=SEED, step=1)
    assert np.array_equal(kdev.to_host(out), f32_to_bf16_stochastic(x, SEED, 1))


def test_from_bf16_kernel_matches_reference_bit_for_bit(kdev, rng):
    b = np.concatenate([rng.integers(0, 2**16, 1000).astype(np.uint16), f32_to_bf16(f32_of_bits(list(SPECIAL)))])
    out = poison_f32(kdev, b.shape)
    from_bf16(kdev, out, kdev.asarray(b))
    assert np.array_equal(bits_of(kdev.to_host(out)), b.astype(np.uint32) << 16)


def test_to_bf16_rejects_an_unknown_mode(kdev):
    with pytest.raises(ValueError):
        to_bf16(kdev, kdev.asarray(np.zeros(3, np.uint16)), kdev.asarray(np.zeros(3, np.float32)), "up")


# ---- stochastic rounding: unbiased, reproducible ---------------------------------------------------------
# bf16 values (bits) with a dropped fraction (in 1/65536 of a step) added: positive, negative, subnormal, huge
UNBIASED = [(0x3F80, 1), (0x3F80, 6554), (0x3F80, 32768), (0xC040, 49152), (0xC040, 58982),
            (0x0003, 20000), (0x7E00, 65535), (0xBA83, 12345)]


@pytest.mark.parametrize("base, frac", UNBIASED)
def test_stochastic_rounding_is_unbiased(base, frac):
    # 4 steps x 25,000 element indices: 100,000 roundings of one value (its own seed: independent checks)
    x32 = f32_of_bits(np.uint32(base << 16 | frac))
    seed = SEED + base + frac
    rounded = np.concatenate([bf16_to_f32(f32_to_bf16_stochastic(np.full(25_000, x32), seed, step))
                              for step in range(4)]).astype(np.float64)
    x, lo = float(x32), float(bf16_to_f32(np.uint16(base)))
    hi = float(bf16_to_f32(np.uint16(base + 1)))
    # rounding up has probability p = frac / 2^16; the mean of N roundings has standard error
    # |hi - lo| sqrt(p (1 - p) / N) when the rounding is unbiased
    p = frac / 2**16
    se = abs(hi - lo) * np.sqrt(p * (1 - p) / rounded.size)
    z = (rounded.mean() - x) / se
    print(f"x={x:.9g}: mean of {rounded.size} roundings {rounded.mean():.9g}, {z:+.2f} standard errors")
    assert abs(z) < 3
    assert np.all((rounded == lo) | (rounded == hi))


def test_stochastic_rounding_is_unbiased_in_the_kernel_too(kdev):
    x = np.full(2000, f32_of_bits(np.uint32(0x3F80 << 16 | 16384)))      # 1 + 1/4 of a bf16 step
    out = kdev.zeros(x.shape, np.uint16)
    to_bf16(kdev, out, kdev.asarray(x), "stochastic", seed=SEED, step=0)
    up = np.mean(kdev.to_host(out) == 0x3F81)
    se = np.sqrt(0.25 * 0.75 / x.size)
    assert abs(up - 0.25) < 3 * se, f"rounded up {up:.4f} of the time, expected 0.25 +- {se:.4f}"


def test_stochastic_rounding_repeats_for_the_same_seed_index_and_step(kdev, rng):
    x = rng.normal(size=500).astype(np.float32)
    runs = []
    for seed, step, offset in [(SEED, 3, 0), (SEED, 3, 0), (SEED, 4, 0), (SEED + 1, 3, 0), (SEED, 3, 100)]:
        out = poison_u16(kdev, x.shape)
        to_bf16(kdev, out, kdev.asarray(x), "stochastic", seed=seed, step=step, offset=offset)
        runs.append(kdev.to_host(out))
    assert np.array_equal(runs[0], runs[1])                                # same inputs, same bits
    for other in runs[2:]:                                                 # another step, seed or index:
        assert 0.2 < np.mean(runs[0] != other) < 0.5                       # 2p(1-p): a third on average
    # the offset only moves the index: element k at offset o draws what element o + k draws at offset 0
    y = rng.normal(size=700).astype(np.float32)
    assert np.array_equal(f32_to_bf16_stochastic(y[100:600], SEED, 3, offset=100),
                          f32_to_bf16_stochastic(y, SEED, 3)[100:600])


def test_random_words_are_uniform_over_indices_and_over_steps():
    def chi2(r, bins):
        counts = np.bincount((r & 0xFFFF) * bins >> 16, minlength=bins)      # the 16 bits rounding uses
        expected = r.size / bins
        return np.sum((counts - expected) ** 2 / expected)
    over_indices = random_u32(SEED, np.arange(2**16), 9)
    over_steps = np.array([random_u32(SEED, np.array([42]), t)[0] for t in range(4096)])
    assert np.unique(over_indices).size == 2**16                           # one step: a bijection
    # chi-square with 255 and 63 degrees of freedom: mean 255 / 63, standard deviation 22.6 / 11.2
    assert chi2(over_indices, 256) < 255 + 5 * 22.6
    assert chi2(over_steps, 64) < 63 + 5 * 11.2


# ---- why ZeRO-2 accumulates bf16 gradients with stochastic rounding -------------------------------------
def test_small_gradients_vanish_with_nearest_but_survive_stochastic_accumulation():
    # 10,000 micro-steps each add g = 2^-10 (~0.000977) to accumulators starting at 1.0. bf16 keeps 8
    # significant bits: at 1.0 its step is 2^-7, so g is 1/8 of a step, below the half step round-to-nearest
    # needs. 1024 accumulators, each drawing its own random bits.
    n, steps, start, g = 1024, 10_000, 1.0, 2.0**-10
    exact = start + steps * g                                              # float64: 10.765625
    gbits = f32_to_bf16(np.float32(g))
    nearest, stochastic = f32_to_bf16(np.full(n, start)), f32_to_bf16(np.full(n, start))
    slot = np.empty(n, np.uint16)
    for t in range(steps):
        slot[...] = gbits
        accumulate_shard_bf16_ref(nearest, slot, 0, SEED, t, stochastic=False)
        slot[...] = gbits
        accumulate_shard_bf16_ref(stochastic, slot, 0, SEED, t)
    near, sr = bf16_to_f32(nearest).astype(np.float64), bf16_to_f32(stochastic).astype(np.float64)
    mean_err = abs(sr.mean() - exact) / exact
    rms_err = np.sqrt(np.mean((sr - exact) ** 2)) / exact
    print(f"\n{steps} adds of g = 2^-10 = {g:.6g} into bf16 1.0 (step 2^-7): float64 sum {exact:.6g}")
    print(f"  round to nearest: every accumulator {near[0]:.6g} (lost {(exact - near[0]) / (exact - start):.0%} "
          f"of the increment)")
    print(f"  stochastic:       mean {sr.mean():.6g} ({mean_err:.2%} off), rms error per accumulator "
          f"{rms_err:.2%}, range {sr.min():.4g} .. {sr.max():.4g}")
    # round to nearest never moves: every add is below half a step
    assert np.all(near == start)
    # stochastic: right on average over the accumulators, and each one within a few percent (the spread
    # expected from sum p(1-p) step^2 over the adds is 5.3%)
    assert mean_err < 0.005
    assert rms_err < 0.08


# ---- the accessors ------------------------------------------------------------------------------------
@cuda.jit
def accessor_kernel(out, acc, x):
    """out, x: (R,C), any storage; acc: (R*C,). out[r,c] = x[r,c] (tuple index); acc[i] += 2 x[r,c] (int)."""
    R, C = x.shape
    i = cuda.grid(1)
    if i < R * C:
        r, c = i // C, i % C
        v = load(x, (r, c))
        store(out, (r, c), v)
        store_add(acc, i, v + v)


# float32 patterns where rounding to bf16 goes wrong first (tests/test_bf16.py checks them by hand)
EDGE_BITS = [0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x0000FFFF, 0x00008000, 0x00018000,
             0x007FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF]


# x + x overflows to inf for the largest patterns, in the simulator's threads (which np.errstate cannot reach)
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_store_rounds_float32_to_nearest_bf16_bit_for_bit(kdev, rng):
    x = np.concatenate([rng.normal(size=100).astype(np.float32) * 1e3,
                        np.array(EDGE_BITS, np.uint32).view(np.float32)]).reshape(4, -1)   # (4, 29)
    out = poisoned_bf16(kdev, x.shape)
    acc = kdev.asarray(np.zeros(x.size, np.uint16))
    kdev.launch(accessor_kernel, 4, 32, out, acc, kdev.asarray(x))
    # the integer arithmetic of llmz.bf16: the same bits, ties to even and overflow to inf included
    np.testing.assert_array_equal(kdev.to_host(out), f32_to_bf16(x))
    with np.errstate(over="ignore"):
        want = f32_to_bf16(np.float32(0) + (x + x).reshape(-1))        # acc starts at +0: +0 + -0 is +0
    np.testing.assert_array_equal(kdev.to_host(acc), want)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_load_widens_bf16_exactly_and_store_add_rounds_the_float32_sum(kdev, rng):
    x = np.concatenate([rng.integers(0, 2**16, 200), [0x0000, 0x8000, 0x0001, 0x7F7F, 0x7F80, 0xFF80]])
    x = x.astype(np.uint16)
    x = x[~np.isnan(bf16_to_f32(x))].reshape(1, -1)
    start = rand_bf16(rng, x.size)
    out = kdev.full(x.shape, np.nan, np.float32)
    acc = kdev.asarray(start)
    kdev.launch(accessor_kernel, 7, 32, out, acc, kdev.asarray(x))
    # bf16 -> float32 is exact: the 16 bits on top, 16 zero bits below
    np.testing.assert_array_equal(kdev.to_host(out).view(np.uint32), x.astype(np.uint32) << 16)
    # acc: float32 add of the widened start and 2x, one rounding to nearest
    with np.errstate(over="ignore"):
        want = f32_to_bf16(bf16_to_f32(start) + (bf16_to_f32(x) + bf16_to_f32(x)).reshape(-1))
    np.testing.assert_array_equal(kdev.to_host(acc), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accessors_on_float_arrays_are_plain_loads_and_stores(kdev, rng, dtype):
    x = rng.normal(size=(3, 40)).astype(dtype)
    start = rng.normal(size=x.size).astype(dtype)
    out, acc = kdev.full(x.shape, np.nan, dtype), kdev.asarray(start)
    kdev.launch(accessor_kernel, 4, 32, out, acc, kdev.asarray(x))
    np.testing.assert_array_equal(kdev.to_host(out), x)
    np.testing.assert_array_equal(kdev.to_host(acc), start + (x + x).reshape(-1))


def test_run_in_f32_rounds_only_the_written_bf16_arrays():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = f32_to_bf16(np.array([0.1, 0.2, 0.3]))
    b0 = b.copy()
    c = np.full(3, NAN_BF16, np.uint16)

    def ref(a, b, c):
        assert a.dtype == b.dtype == c.dtype == np.float32
        c[...] = a + b
        b[...] = 0                                  # not in `written`: the caller's b must stay as it was
    run_in_f32(ref, (a, b, c), written=(2,))
    np.testing.assert_array_equal(b, b0)
    np.testing.assert_array_equal(c, f32_to_bf16(a + bf16_to_f32(b0)))


# ---- on the GPU, at real sizes -------------------------------------------------------------------------
BLOCK_BUCKET = 7_087_872                                                   # one GPT-2 124M block's parameters


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_to_bf16_kernel_matches_reference_at_gpt2_block_size(kdev, rng, mode):
    x = rng.normal(size=BLOCK_BUCKET).astype(np.float32) * 0.02
    out = kdev.zeros(x.shape, np.uint16)
    to_bf16(kdev, out, kdev.asarray(x), mode, seed=SEED, step=11, offset=85_000_000)
    want = f32_to_bf16_stochastic(x, SEED, 11, 85_000_000) if mode == "stochastic" else f32_to_bf16(x)
    assert np.array_equal(kdev.to_host(out), want)


@pytest.mark.gpu
def test_small_gradients_survive_10000_stochastic_accumulations_on_the_gpu(kdev):
    n, steps, start, g = 1 << 20, 10_000, 1.0, 2.0**-10
    exact = start + steps * g
    gbits = f32_to_bf16(np.float32(g))
    acc = {mode: kdev.asarray(f32_to_bf16(np.full(n, start))) for mode in (True, False)}
    slot = kdev.zeros(n, np.uint16)
    for t in range(steps):
        for stochastic in (True, False):
            slot.fill(int(gbits.reshape(-1)[0]))
            accumulate_shard_bf16(kdev, acc[stochastic], slot, 0, SEED, t, stochastic)
    sr = bf16_to_f32(kdev.to_host(acc[True])).astype(np.float64)
    near = bf16_to_f32(kdev.to_host(acc[False]))
    mean_err, rms_err = abs(sr.mean() - exact) / exact, np.sqrt(np.mean((sr - exact) ** 2)) / exact
    print(f"{n} accumulators, {steps} adds of 2^-10 into 1.0: float64 {exact}, nearest {near[0]}, "
          f"stochastic mean {sr.mean():.6g} ({mean_err:.3%} off), rms {rms_err:.2%}")
    assert np.all(near == start) and mean_err < 0.001 and rms_err < 0.08


# ---- lesson 04 runs and passes its checkpoints -------------------------------------------------------------
def test_lesson_04_passes_its_checkpoints_on_cpu():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "lessons.04_stochastic_rounding", "--device", "cpu",
                          "--steps", "2000"], check=False, cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 of 6 checkpoints passed" in out.stdout
