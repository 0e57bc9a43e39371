"""bf16 activations stored as uint16 bits: the element accessors (load / store / store_add) and every kernel
converted to them, in the simulator, with uint16 inputs and outputs.

Each kernel is checked twice: against round_to_nearest(the same kernel on float32 copies of the bf16 inputs),
bit for bit (the uint16 specialisation does the float32 path's arithmetic and rounds at the store), and
against the NumPy reference's bf16 path (llmz.bf16.run_in_f32): bit for bit where the reference adds in the
same order, within one bf16 step where the order or the formula differs."""
import numpy as np
import pytest
from numba import cuda

from llmz.bf16 import bf16_to_f32, f32_to_bf16, run_in_f32
from llmz.kernels.bf16 import load, store, store_add
from llmz.kernels.encoder import (
    encoder_backward,
    encoder_backward_ref,
    encoder_forward,
    encoder_forward_ref,
    wte_buckets_upload,
)
from llmz.kernels.gelu import gelu_backward, gelu_backward_ref, gelu_forward, gelu_forward_ref
from llmz.kernels.reduce import column_sum, column_sum_ref
from llmz.kernels.residual import (
    residual_backward,
    residual_backward_ref,
    residual_forward,
    residual_forward_ref,
)

NAN_BF16 = 0x7FC0                   # bf16's quiet NaN: the poison of a uint16 output
SHAPE = (3, 5, 7)                   # 105 elements: not a multiple of the simulator's 32-thread block


# ---- helpers ------------------------------------------------------------------------------------------
def poisoned_bf16(dev, shape):
    """A uint16 output filled with the bf16 NaN pattern: an element the kernel never writes fails."""
    return dev.full(shape, NAN_BF16, np.uint16)


def rand_bf16(rng, shape, scale=1.0) -> np.ndarray:
    """Random normal values rounded to bf16 bits (uint16)."""
    return f32_to_bf16(rng.normal(size=shape) * scale)


def steps_apart(a, b) -> np.ndarray:
    """bf16 bits a, b -> how many representable bf16 values apart they are (+0 and -0 count as one value)."""
    def ordered(x):
        x = np.asarray(x, np.uint16).astype(np.int64)
        return np.where(x & 0x8000, -(x & 0x7FFF), x)
    return np.abs(ordered(a) - ordered(b))


def assert_within_one_step(got, want, atol=0.0):
    """uint16 bits: every element within one bf16 step of want, or within atol of it (where a sum cancels
    to near zero, the float32 rounding of its terms can move it more than a step of the small result)."""
    assert not np.any(np.isnan(bf16_to_f32(got))), "NaN in the output: an element was not written"
    far = (steps_apart(got, want) > 1) & (np.abs(bf16_to_f32(got) - bf16_to_f32(want)) > atol)
    assert not far.any(), f"{far.sum()} elements more than one bf16 step off, e.g. {bf16_to_f32(got)[far][:5]}" \
                          f" vs {bf16_to_f32(want)[far][:5]}"


# float32 tanh(u) for u < -4 lies within 2^-24 (one float32 step below 1) of -1: 1 + tanh u and 1 - tanh^2 u,
# the factors of gelu and gelu', are then all rounding. The kernel (math.tanh: tanhf on the GPU, a float64 tanh
# rounded to float32 in the simulator) and the reference (NumPy's float32 tanh, itself up to an ulp off) may
# differ by a float32 step or two in t, and t * t rounds once more; a change dt in t moves gelu by 0.5 x dt and
# gelu' by (0.5 - x t s (1 + 3c x^2)) dt. So the two agree to an ABSOLUTE error of a few 2^-24 times those
# factors (x = -5.25, dout = 2: gelu' dout 2.3e-6 in the reference, 1.2e-6 in the kernel, 5.7e-7 exact), not
# to a fixed 1e-6 (the LLMZ_TEST_SEED=3459431758 failure). Four float32 steps of t:
TANH_STEPS = 4 * 2.0 ** -24


def gelu_forward_noise(x):
    """Per element: how far two float32 gelu(x) may be apart from the float32 rounding of tanh near +-1."""
    return TANH_STEPS * 0.5 * np.abs(x)


def gelu_backward_noise(x, dout, start=0.0):
    """Per element: the same for dinp = start + gelu'(x) dout: the tanh rounding through d(gelu')/dt, plus a
    float32 rounding of each term where start + gelu' dout cancels."""
    s, c = np.sqrt(2.0 / np.pi), 0.044715
    x = np.abs(x.astype(np.float64))
    slope = 0.5 + x * s * (1.0 + 3.0 * c * x * x)
    return TANH_STEPS * (slope * np.abs(dout) + np.abs(start))


def widen(dev, bits):
    """Device uint16 bits -> a device float32 copy of their values (the float32 kernel's inputs)."""
    return dev.asarray(bf16_to_f32(dev.to_host(bits)))


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


# ---- gelu -------------------------------------------------------------------------------------------
def test_gelu_forward_kernel_on_bf16_is_the_rounded_float32_kernel(kdev, rng):
    x = rand_bf16(rng, SHAPE, 2.0)
    out = poisoned_bf16(kdev, SHAPE)
    gelu_forward(kdev, out, kdev.asarray(x))
    out32 = kdev.full(SHAPE, np.nan, np.float32)
    gelu_forward(kdev, out32, kdev.asarray(bf16_to_f32(x)))
    got = kdev.to_host(out)
    # the same float32 arithmetic, one rounding at the store: bit for bit
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(out32)))
    ref = np.full(SHAPE, NAN_BF16, np.uint16)
    gelu_forward_ref(ref, x)
    # the reference groups the cube differently and has its own tanh: float32 results a few ulps apart, so
    # at most one bf16 step, or the tanh rounding's absolute noise where 1 + tanh(u) cancels (x < -4)
    assert_within_one_step(got, ref, atol=gelu_forward_noise(bf16_to_f32(x)))


def test_gelu_backward_kernel_on_bf16_is_the_rounded_float32_kernel_and_accumulates(kdev, rng):
    x, dout, start = rand_bf16(rng, 105, 2.0), rand_bf16(rng, 105), rand_bf16(rng, 105)
    dinp = kdev.asarray(start)                      # accumulates: starts random
    gelu_backward(kdev, dinp, kdev.asarray(x), kdev.asarray(dout))
    dinp32 = kdev.asarray(bf16_to_f32(start))
    gelu_backward(kdev, dinp32, kdev.asarray(bf16_to_f32(x)), kdev.asarray(bf16_to_f32(dout)))
    got = kdev.to_host(dinp)
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(dinp32)))
    ref = start.copy()
    gelu_backward_ref(ref, x, dout)
    # float32 results a few ulps apart, or the tanh rounding's absolute noise (x < -4, or start + gelu' dout
    # cancelling)
    assert_within_one_step(got, ref, atol=gelu_backward_noise(bf16_to_f32(x), bf16_to_f32(dout), bf16_to_f32(start)))


def test_gelu_backward_kernel_on_bf16_overwrites_as_the_rounded_float32_kernel(kdev, rng):
    x, dout = rand_bf16(rng, 105, 2.0), rand_bf16(rng, 105)
    dinp = poisoned_bf16(kdev, 105)                 # overwrites: a read of dinp would leave NaN
    gelu_backward(kdev, dinp, kdev.asarray(x), kdev.asarray(dout), accumulate=False)
    dinp32 = kdev.full(105, np.nan, np.float32)
    gelu_backward(kdev, dinp32, kdev.asarray(bf16_to_f32(x)), kdev.asarray(bf16_to_f32(dout)), accumulate=False)
    got = kdev.to_host(dinp)
    np.testing.assert_array_equal(got, f32_to_bf16(kdev.to_host(dinp32)))
    ref = np.full(105, NAN_BF16, np.uint16)
    gelu_backward_ref(ref, x, dout, accumulate=False)
    # float32 results a few ulps apart: at most one bf16 step, or the tanh rounding's absolute noise (x < -4)
    assert_within_one_step(got, ref, atol=gelu_backward_noise(bf16_to_f32(x), bf16_to_f32(dout)))


# ---- residual ---------------------------------------------------------------------------------------
def test_residual_kernels_on_bf16_match_the_bf16_reference_bit_for_bit(kdev, rng):
    a, b, dout, s1, s2 = (rand_bf16(rng, SHAPE) for _ in range(5))
    out = poisoned_bf16(kdev, SHAPE)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    dinp1, dinp2 = kdev.asarray(s1), kdev.asarray(s2)     # accumulate: start random
    residual_backward(kdev, dinp1, dinp2, kdev.asarray(dout))
    ref, r1, r2 = np.full(SHAPE, NAN_BF16, np.uint16), s1.copy(), s2.copy()
    residual_forward_ref(ref, a, b)
    residual_backward_ref(r1, r2, dout)
    # one float32 add of exact bf16 values, one rounding: the reference does the same
    np.testing.assert_array_equal(kdev.to_host(out), ref)
    np.testing.assert_array_equal(kdev.to_host(dinp1), r1)
    np.testing.assert_array_equal(kdev.to_host(dinp2), r2)


def test_residual_forward_kernel_mixes_float32_and_bf16_arrays(kdev, rng):
    a = rng.normal(size=SHAPE).astype(np.float32)          # a float32 stream plus a bf16 one, into bf16
    b = rand_bf16(rng, SHAPE)
    out = poisoned_bf16(kdev, SHAPE)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    ref = np.full(SHAPE, NAN_BF16, np.uint16)
    residual_forward_ref(ref, a, b)
    np.testing.assert_array_equal(kdev.to_host(out), ref)
    np.testing.assert_array_equal(ref, f32_to_bf16(a + bf16_to_f32(b)))


# ---- encoder ------------------------------------------------------------------------------------------
# B=2, T=3; token 1 three times, token 4 twice; rows 0, 2, 5, 6 of wte unused. C=20, Vp=7, maxT=5.
TOKENS = np.array([[1, 4, 1], [3, 1, 4]], dtype=np.int32)
VP, MAXT, C = 7, 5, 20


@pytest.mark.parametrize("token_dtype", [np.int32, np.uint16])    # uint16: as llm.c token files store them
def test_encoder_forward_kernel_on_bf16_matches_the_bf16_reference_bit_for_bit(kdev, rng, token_dtype):
    tokens = TOKENS.astype(token_dtype)
    B, T = tokens.shape
    wte, wpe = rand_bf16(rng, (VP, C)), rand_bf16(rng, (MAXT, C))
    out = poisoned_bf16(kdev, (B, T, C))
    encoder_forward(kdev, out, kdev.asarray(tokens), kdev.asarray(wte), kdev.asarray(wpe))
    ref = np.full((B, T, C), NAN_BF16, np.uint16)
    encoder_forward_ref(ref, tokens, wte, wpe)
    # one float32 add, one rounding (uint16 token ids stay ids: the reference converts only the data)
    np.testing.assert_array_equal(kdev.to_host(out), ref)
    np.testing.assert_array_equal(ref, f32_to_bf16(bf16_to_f32(wte)[TOKENS] + bf16_to_f32(wpe)[:T]))


def rounded_sequential_wte(dwte, dout, tokens):
    """The teaching kernel's order in bf16: position by position, each add in float32 rounded to nearest."""
    w = dwte.copy()
    for pos, tok in enumerate(tokens.reshape(-1)):
        w[tok] = f32_to_bf16(bf16_to_f32(w[tok]) + bf16_to_f32(dout.reshape(-1, dout.shape[-1])[pos]))
    return w


def test_encoder_backward_teaching_kernel_on_bf16_rounds_after_every_add(kdev, rng):
    B, T = TOKENS.shape
    dout = rand_bf16(rng, (B, T, C))
    dwte0, dwpe0 = rand_bf16(rng, (VP, C)), rand_bf16(rng, (MAXT, C))   # accumulates: starts random
    dwte, dwpe = kdev.asarray(dwte0), kdev.asarray(dwpe0)
    encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), kdev.asarray(TOKENS))
    got_wte, got_wpe = kdev.to_host(dwte), kdev.to_host(dwpe)
    # one thread per channel visits the positions in order and rounds each add: emulated bit for bit
    np.testing.assert_array_equal(got_wte, rounded_sequential_wte(dwte0, dout, TOKENS))
    # dwpe: the batch summed in a different order than the reference's, one rounding at the end
    ref_wte, ref_wpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(ref_wte, ref_wpe, dout, TOKENS)
    assert_within_one_step(got_wpe, ref_wpe, atol=1e-5)
    # rows of unused tokens and positions t >= T are untouched
    np.testing.assert_array_equal(got_wte[[0, 2, 5, 6]], dwte0[[0, 2, 5, 6]])
    np.testing.assert_array_equal(got_wpe[T:], dwpe0[T:])


def test_encoder_backward_bucket_kernel_on_bf16_matches_the_bf16_reference(kdev, rng):
    tokens = rng.integers(0, 5, size=(4, 8)).astype(np.int32)        # about six repeats per id, 5..8 unused
    B, T = tokens.shape
    vp, c = 9, 45                                                     # C above the 32-thread block
    dout = rand_bf16(rng, (B, T, c))
    dwte0, dwpe0 = rand_bf16(rng, (vp, c)), rand_bf16(rng, (MAXT + T, c))
    buckets = wte_buckets_upload(kdev, tokens)
    runs = []
    for _ in range(2):                                                # twice: the same bits
        dwte, dwpe = kdev.asarray(dwte0), kdev.asarray(dwpe0)
        encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), kdev.asarray(tokens), buckets=buckets)
        runs.append((kdev.to_host(dwte), kdev.to_host(dwpe)))
    ref_wte, ref_wpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(ref_wte, ref_wpe, dout, tokens)
    # each (token, channel) summed in its own order, then one rounding: within one bf16 step of the
    # reference (1e-5 absolute: float32 rounding of ~10 terms of size ~1 where the sum cancels)
    assert_within_one_step(runs[0][0], ref_wte, atol=1e-5)
    assert_within_one_step(runs[0][1], ref_wpe, atol=1e-5)
    # bf16 rounding of the float32 kernel's result, bit for bit
    dwte32, dwpe32 = kdev.asarray(bf16_to_f32(dwte0)), kdev.asarray(bf16_to_f32(dwpe0))
    encoder_backward(kdev, dwte32, dwpe32, kdev.asarray(bf16_to_f32(dout)), kdev.asarray(tokens), buckets=buckets)
    np.testing.assert_array_equal(runs[0][0], f32_to_bf16(kdev.to_host(dwte32)))
    np.testing.assert_array_equal(runs[0][1], f32_to_bf16(kdev.to_host(dwpe32)))
    unused = sorted(set(range(vp)) - set(tokens.reshape(-1).tolist()))
    np.testing.assert_array_equal(runs[0][0][unused], dwte0[unused])
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


# ---- column sums --------------------------------------------------------------------------------------
# x and out each float32 or bf16; (37,45): off the chunk, lane and strip grids; rows_per_block=5: a chunk
# that is not a multiple of the lanes
@pytest.mark.parametrize("x_bf16, out_bf16, rows_per_block", [(True, True, None), (True, True, 5),
                                                              (True, False, None), (False, True, None)])
def test_column_sum_kernel_on_bf16_matches_the_bf16_reference(kdev, rng, x_bf16, out_bf16, rows_per_block):
    N, C_ = 37, 45
    x = rand_bf16(rng, (N, C_)) if x_bf16 else rng.normal(size=(N, C_)).astype(np.float32)
    start = rand_bf16(rng, C_) if out_bf16 else rng.normal(size=C_).astype(np.float32)
    x_d = kdev.asarray(x)
    out = kdev.asarray(start)                                         # accumulates: starts random
    column_sum(kdev, out, x_d, rows_per_block=rows_per_block)
    fresh = poisoned_bf16(kdev, C_) if out_bf16 else kdev.full(C_, np.nan, np.float32)
    column_sum(kdev, fresh, x_d, accumulate=False, rows_per_block=rows_per_block)
    for got, accumulate in ((kdev.to_host(out), True), (kdev.to_host(fresh), False)):
        ref = start.copy()
        column_sum_ref(ref, x, accumulate=accumulate)
        if out_bf16:
            # sums of 37 terms of size ~1 in another order (float64 in the reference): within one bf16 step,
            # 1e-4 absolute where a column cancels to near zero
            assert_within_one_step(got, ref, atol=1e-4)
        else:
            # float32 out: one float32 rounding of start + sum, the order apart
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


# ---- on the GPU at GPT-2 size: each bf16 kernel against the float32 kernel on the same (widened) inputs ----
# bf16 keeps 8 significant bits: rounding to nearest moves a value by less than 2^-8 of it (half the spacing
# 2^-7 at the bottom of a binade). The compiled uint16 kernels do the float32 kernels' arithmetic op for op
# (the same PTX float instructions), so the bf16 result should be the float32 result rounded, bit for bit:
# printed, not asserted.
REL_BF16 = 2.0 ** -8
GPT2 = {"B": 16, "T": 1024, "C": 768, "V": 50257, "Vp": 50304, "maxT": 1024}


def assert_rounded_float32(name, got_bits, want32, rel=REL_BF16):
    got, want = bf16_to_f32(got_bits).astype(np.float64), want32.astype(np.float64)
    err = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    same = np.mean(got_bits == f32_to_bf16(want32))
    print(f"{name}: worst relative error per element {err.max():.3e} (bound {rel:.3e}); "
          f"{same:.4%} bit-identical to round_to_nearest(float32 kernel)")
    assert err.max() <= rel


def f32_copy(dev, bits_host):
    return dev.asarray(bf16_to_f32(bits_host))


@pytest.mark.gpu
def test_gelu_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    shape = (GPT2["B"], GPT2["T"], 4 * GPT2["C"])                     # the MLP's hidden activations
    x, dout, start = rand_bf16(rng, shape, 2.0), rand_bf16(rng, shape), rand_bf16(rng, shape)
    out, out32 = poisoned_bf16(kdev, shape), kdev.full(shape, np.nan, np.float32)
    gelu_forward(kdev, out, kdev.asarray(x))
    gelu_forward(kdev, out32, f32_copy(kdev, x))
    assert_rounded_float32("gelu forward", kdev.to_host(out), kdev.to_host(out32))
    dinp, dinp32 = kdev.asarray(start), f32_copy(kdev, start)
    gelu_backward(kdev, dinp, kdev.asarray(x), kdev.asarray(dout))
    gelu_backward(kdev, dinp32, f32_copy(kdev, x), f32_copy(kdev, dout))
    assert_rounded_float32("gelu backward", kdev.to_host(dinp), kdev.to_host(dinp32))


@pytest.mark.gpu
def test_residual_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    shape = (GPT2["B"], GPT2["T"], GPT2["C"])
    a, b, dout, s1, s2 = (rand_bf16(rng, shape) for _ in range(5))
    out, out32 = poisoned_bf16(kdev, shape), kdev.full(shape, np.nan, np.float32)
    residual_forward(kdev, out, kdev.asarray(a), kdev.asarray(b))
    residual_forward(kdev, out32, f32_copy(kdev, a), f32_copy(kdev, b))
    assert_rounded_float32("residual forward", kdev.to_host(out), kdev.to_host(out32))
    d1, d2, d1_32, d2_32 = kdev.asarray(s1), kdev.asarray(s2), f32_copy(kdev, s1), f32_copy(kdev, s2)
    residual_backward(kdev, d1, d2, kdev.asarray(dout))
    residual_backward(kdev, d1_32, d2_32, f32_copy(kdev, dout))
    assert_rounded_float32("residual backward dinp1", kdev.to_host(d1), kdev.to_host(d1_32))
    assert_rounded_float32("residual backward dinp2", kdev.to_host(d2), kdev.to_host(d2_32))


@pytest.mark.gpu
def test_encoder_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    B, T, C_, Vp, maxT = (GPT2[k] for k in ("B", "T", "C", "Vp", "maxT"))
    tokens = rng.integers(0, GPT2["V"], size=(B, T)).astype(np.int32)
    tokens[1, :16] = tokens[0, :16]                                   # repeats across the batch
    wte, wpe, dout = rand_bf16(rng, (Vp, C_)), rand_bf16(rng, (maxT, C_)), rand_bf16(rng, (B, T, C_))
    inp = kdev.asarray(tokens)
    out, out32 = poisoned_bf16(kdev, (B, T, C_)), kdev.full((B, T, C_), np.nan, np.float32)
    encoder_forward(kdev, out, inp, kdev.asarray(wte), kdev.asarray(wpe))
    encoder_forward(kdev, out32, inp, f32_copy(kdev, wte), f32_copy(kdev, wpe))
    assert_rounded_float32("encoder forward", kdev.to_host(out), kdev.to_host(out32))
    # backward, the bucket kernel (the one training uses): one rounding per (token, channel)
    dwte0, dwpe0 = rand_bf16(rng, (Vp, C_), 1e-2), rand_bf16(rng, (maxT, C_), 1e-2)
    buckets = wte_buckets_upload(kdev, tokens)
    results = {}
    for name, b in (("buckets", buckets), ("teaching", None)):
        dwte, dwpe = kdev.asarray(dwte0), kdev.asarray(dwpe0)
        encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), inp, buckets=b)
        dwte32, dwpe32 = f32_copy(kdev, dwte0), f32_copy(kdev, dwpe0)
        encoder_backward(kdev, dwte32, dwpe32, f32_copy(kdev, dout), inp, buckets=b)
        results[name] = [kdev.to_host(a) for a in (dwte, dwpe, dwte32, dwpe32)]
    dwte, dwpe, dwte32, dwpe32 = results["buckets"]
    assert_rounded_float32("encoder backward dwte (buckets)", dwte, dwte32)
    assert_rounded_float32("encoder backward dwpe", dwpe, dwpe32)
    # the teaching kernel rounds after every add: a token seen k times carries up to k roundings, each
    # within 2^-8 of a partial sum, itself at most |start| + sum |dout| over the token's positions
    dwte, _, dwte32, _ = results["teaching"]
    counts = np.bincount(tokens.reshape(-1), minlength=Vp)[:, None]
    size = np.abs(bf16_to_f32(dwte0)).astype(np.float64)
    np.add.at(size, tokens.reshape(-1), np.abs(bf16_to_f32(dout)).reshape(-1, C_))
    err = np.abs(bf16_to_f32(dwte).astype(np.float64) - dwte32)
    seen = counts[:, 0] > 0
    ratio = err[seen] / (counts[seen] * size[seen])
    print(f"encoder backward dwte (teaching): worst error / (k |terms|) {ratio.max():.3e} (bound {REL_BF16:.3e}); "
          f"most repeats k = {counts.max()}")
    assert ratio.max() <= REL_BF16
    np.testing.assert_array_equal(dwte[~seen], dwte0[~seen])         # unused rows untouched


@pytest.mark.gpu
def test_column_sum_bf16_kernel_matches_float32_kernel_at_gpt2_size(kdev, rng):
    N, C_ = GPT2["B"] * GPT2["T"], GPT2["C"]
    x, start = rand_bf16(rng, (N, C_)), rand_bf16(rng, C_)
    out, out32 = kdev.asarray(start), f32_copy(kdev, start)
    column_sum(kdev, out, kdev.asarray(x))
    column_sum(kdev, out32, f32_copy(kdev, x))
    assert_rounded_float32("column_sum (accumulate)", kdev.to_host(out), kdev.to_host(out32))
    fresh, fresh32 = poisoned_bf16(kdev, C_), kdev.full(C_, np.nan, np.float32)
    column_sum(kdev, fresh, kdev.asarray(x), accumulate=False)
    column_sum(kdev, fresh32, f32_copy(kdev, x), accumulate=False)
    assert_rounded_float32("column_sum (overwrite)", kdev.to_host(fresh), kdev.to_host(fresh32))
