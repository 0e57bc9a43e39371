"""Encoder: the kernels against the NumPy reference, the reference against finite differences."""
import time

import numpy as np
import pytest

from helpers import finite_diff, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.encoder import (
    encoder_backward,
    encoder_backward_ref,
    encoder_backward_wte_bucket_kernel,
    encoder_forward,
    encoder_forward_ref,
    wte_buckets,
    wte_buckets_upload,
    wte_table_size,
)

# B=2, T=3, C=20 (below the simulator's 32-thread block; B*T*C = 120 not a multiple of it); Vp=7, maxT=5 > T.
# Token 1 appears three times (twice in batch 0, once in batch 1) and token 4 twice: repeated ids accumulate.
# Rows 0, 2, 5, 6 of wte are never used: their gradient must stay as it started.
TOKENS = np.array([[1, 4, 1], [3, 1, 4]], dtype=np.int32)
VP, MAXT, C = 7, 5, 20


def forward64(inp, wte, wpe):
    out = np.empty(inp.shape + (wte.shape[1],))
    encoder_forward_ref(out, inp, wte, wpe)
    return out


def test_encoder_forward_kernel_matches_reference(kdev, rng):
    B, T = TOKENS.shape
    wte = rng.normal(size=(VP, C)).astype(np.float32)
    wpe = rng.normal(size=(MAXT, C)).astype(np.float32)
    out = poisoned(kdev, (B, T, C))
    encoder_forward(kdev, out, kdev.asarray(TOKENS), kdev.asarray(wte), kdev.asarray(wpe))
    ref = np.empty((B, T, C), np.float32)
    encoder_forward_ref(ref, TOKENS, wte, wpe)
    # one correctly rounded float32 add per element: bit-exact against the float32 reference
    np.testing.assert_array_equal(kdev.to_host(out), ref)


def test_encoder_backward_kernel_matches_reference_and_accumulates(kdev, rng):
    B, T = TOKENS.shape
    dout = rng.normal(size=(B, T, C)).astype(np.float32)
    # backward accumulates: start from random non-zero values
    dwte0 = rng.normal(size=(VP, C))
    dwpe0 = rng.normal(size=(MAXT, C))
    dwte = kdev.asarray(dwte0, np.float32)
    dwpe = kdev.asarray(dwpe0, np.float32)
    encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), kdev.asarray(TOKENS))
    ref_wte, ref_wpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(ref_wte, ref_wpe, dout.astype(np.float64), TOKENS)
    # float32 adds, at most 3 terms per element: a few ulps
    assert rel_err(kdev.to_host(dwte), ref_wte) < 1e-6
    assert rel_err(kdev.to_host(dwpe), ref_wpe) < 1e-6
    # rows of unused tokens and positions t >= T are untouched
    unused = [0, 2, 5, 6]
    np.testing.assert_array_equal(kdev.to_host(dwte)[unused], dwte0[unused].astype(np.float32))
    np.testing.assert_array_equal(kdev.to_host(dwpe)[T:], dwpe0[T:].astype(np.float32))


def buckets_by_hand(inp):
    """The bucket table built the plain way, one position at a time (the layout in encoder.py's docstring)."""
    flat = [int(v) for v in np.asarray(inp).reshape(-1)]
    n = len(flat)
    runs = {}
    for pos, tok in enumerate(flat):
        runs.setdefault(tok, []).append(pos)
    table = [len(runs)]
    starts, toks, positions = [], [], []
    for tok in sorted(runs):
        starts.append(len(positions))
        toks.append(tok)
        positions += runs[tok]
    table += starts + [n] * (n + 1 - len(starts))
    table += toks + [-1] * (n - len(toks))
    table += positions
    return np.array(table, dtype=np.int32)


@pytest.mark.parametrize("shape, vocab", [((2, 3), 7), ((4, 25), 9), ((3, 17), 1000), ((1, 1), 5)])
def test_wte_buckets_matches_plain_python_construction(rng, shape, vocab):
    inp = rng.integers(0, vocab, size=shape).astype(np.int32)
    table = wte_buckets(inp)
    assert table.dtype == np.int32 and table.shape == (wte_table_size(inp.size),)
    np.testing.assert_array_equal(table, buckets_by_hand(inp))
    np.testing.assert_array_equal(wte_buckets(TOKENS), buckets_by_hand(TOKENS))


def run_backward(kdev, dout, inp, dwte0, dwpe0, buckets):
    dwte = kdev.asarray(dwte0, np.float32)
    dwpe = kdev.asarray(dwpe0, np.float32)
    encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), kdev.asarray(inp), buckets=buckets)
    return kdev.to_host(dwte), kdev.to_host(dwpe)


# TOKENS: repeats within and across rows, unused rows. (4,8) of 5 ids in a 9-row table with C=45: about six
# repeats per id, ids 5..8 unused, C above the simulator's 32-thread block (two channel blocks per token)
@pytest.mark.parametrize("tokens, vp, c", [(TOKENS, VP, C), ("random", 9, 45)])
def test_encoder_backward_bucket_kernel_matches_reference_and_accumulates(kdev, rng, tokens, vp, c):
    if isinstance(tokens, str):
        tokens = rng.integers(0, 5, size=(4, 8)).astype(np.int32)
    B, T = tokens.shape
    dout = rng.normal(size=(B, T, c)).astype(np.float32)
    # backward accumulates: start from random non-zero values
    dwte0, dwpe0 = rng.normal(size=(vp, c)), rng.normal(size=(MAXT + T, c))
    buckets = wte_buckets_upload(kdev, tokens)
    dwte, dwpe = run_backward(kdev, dout, tokens, dwte0, dwpe0, buckets)
    ref_wte, ref_wpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(ref_wte, ref_wpe, dout.astype(np.float64), tokens)
    # a float64 sum per (token, channel), one float32 rounding of start + sum: about an ulp
    assert rel_err(dwte, ref_wte) < 1e-6
    assert rel_err(dwpe, ref_wpe) < 1e-6
    # rows of unused tokens are untouched
    unused = sorted(set(range(vp)) - set(tokens.reshape(-1).tolist()))
    np.testing.assert_array_equal(dwte[unused], dwte0[unused].astype(np.float32))
    # the same bits on a second run
    again = run_backward(kdev, dout, tokens, dwte0, dwpe0, buckets)
    np.testing.assert_array_equal(dwte, again[0])
    np.testing.assert_array_equal(dwpe, again[1])


def test_encoder_backward_bucket_kernel_strides_over_channels(kdev, rng):
    """One channel block (grid y = 1) for C = 45 above the 32-thread block: each thread takes c and c+32."""
    tokens = rng.integers(0, 4, size=(2, 5)).astype(np.int32)
    dout = rng.normal(size=(10, 45)).astype(np.float32)
    dwte0 = rng.normal(size=(4, 45))
    dwte = kdev.asarray(dwte0, np.float32)
    kdev.launch(encoder_backward_wte_bucket_kernel, (10, 1), 32, dwte, kdev.asarray(dout),
                kdev.asarray(wte_buckets(tokens)))
    ref = dwte0.copy()
    np.add.at(ref, tokens.reshape(-1), dout.astype(np.float64))
    assert rel_err(kdev.to_host(dwte), ref) < 1e-6


def test_encoder_reference_backward_matches_finite_differences(rng):
    B, T = TOKENS.shape
    wte = rng.normal(size=(VP, C))
    wpe = rng.normal(size=(MAXT, C))
    dout = rng.normal(size=(B, T, C))
    dwte, dwpe = np.zeros((VP, C)), np.zeros((MAXT, C))
    encoder_backward_ref(dwte, dwpe, dout, TOKENS)
    idx, g = finite_diff(lambda w: forward64(TOKENS, w, wpe), wte, dout)
    assert rel_err(dwte.reshape(-1)[idx], g) <= 1e-6
    idx, g = finite_diff(lambda w: forward64(TOKENS, wte, w), wpe, dout)
    assert rel_err(dwpe.reshape(-1)[idx], g) <= 1e-6


def test_encoder_reference_on_bf16_storage_rounds_the_float32_reference(rng):
    # uint16 wte, wpe, gradients hold bf16 bits (computed in float32, rounded to nearest); uint16 token ids
    # (llm.c's token files) stay ids
    B, T = TOKENS.shape
    tokens = TOKENS.astype(np.uint16)
    wte, wpe = f32_to_bf16(rng.normal(size=(VP, C))), f32_to_bf16(rng.normal(size=(MAXT, C)))
    out = np.full((B, T, C), 0x7FC0, np.uint16)
    encoder_forward_ref(out, tokens, wte, wpe)
    np.testing.assert_array_equal(out, f32_to_bf16(bf16_to_f32(wte)[TOKENS] + bf16_to_f32(wpe)[:T]))
    dout = f32_to_bf16(rng.normal(size=(B, T, C)))
    dwte0, dwpe0 = f32_to_bf16(rng.normal(size=(VP, C))), f32_to_bf16(rng.normal(size=(MAXT, C)))
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(dwte, dwpe, dout, tokens)
    want_wte, want_wpe = bf16_to_f32(dwte0), bf16_to_f32(dwpe0)
    encoder_backward_ref(want_wte, want_wpe, bf16_to_f32(dout), TOKENS)
    np.testing.assert_array_equal(dwte, f32_to_bf16(want_wte))
    np.testing.assert_array_equal(dwpe, f32_to_bf16(want_wpe))
    np.testing.assert_array_equal(tokens, TOKENS)


@pytest.mark.gpu
def test_encoder_kernels_match_float64_reference_at_gpt2_size(kdev, rng):
    B, T, C_, Vp, maxT = 4, 1024, 768, 50304, 1024
    tokens = rng.integers(0, 50257, size=(B, T)).astype(np.int32)
    tokens[1, :16] = tokens[0, :16]                     # repeats across the batch, on top of random ones
    wte = rng.normal(size=(Vp, C_)).astype(np.float32)
    wpe = rng.normal(size=(maxT, C_)).astype(np.float32)
    dout = rng.normal(size=(B, T, C_)).astype(np.float32)
    out = poisoned(kdev, (B, T, C_))
    encoder_forward(kdev, out, kdev.asarray(tokens), kdev.asarray(wte), kdev.asarray(wpe))
    errs = {"out": rel_err(kdev.to_host(out), forward64(tokens, wte.astype(np.float64), wpe.astype(np.float64)))}
    ref_wte, ref_wpe = np.zeros((Vp, C_)), np.zeros((maxT, C_))
    encoder_backward_ref(ref_wte, ref_wpe, dout.astype(np.float64), tokens)
    bits = []
    for _ in range(2):                                  # twice: deterministic means the same bits
        dwte, dwpe = kdev.zeros((Vp, C_)), kdev.zeros((maxT, C_))
        encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), kdev.asarray(tokens))
        bits.append((kdev.to_host(dwte), kdev.to_host(dwpe)))
    errs.update(dwte=rel_err(bits[0][0], ref_wte), dwpe=rel_err(bits[0][1], ref_wpe))
    print(f"encoder B={B} T={T} C={C_} Vp={Vp}: worst relative error {max(errs.values()):.2e} {errs}")
    # float32 sums of at most B*T terms per element
    assert max(errs.values()) < 1e-5
    np.testing.assert_array_equal(bits[0][0], bits[1][0])
    np.testing.assert_array_equal(bits[0][1], bits[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_encoder_bucket_kernel_matches_float64_reference_at_gpt2_size(kdev, rng, dist):
    B, T, C_, Vp, maxT = 16, 1024, 768, 50304, 1024
    if dist == "uniform":                               # random tokens: a few repeats per id
        tokens = rng.integers(0, 50257, size=(B, T))
    else:                                               # text-like: the commonest ids repeat hundreds of times
        tokens = np.minimum(rng.zipf(1.2, size=(B, T)) - 1, 50256)
    tokens = tokens.astype(np.int32)
    dout = rng.normal(size=(B, T, C_)).astype(np.float32)
    ref_wte, ref_wpe = np.zeros((Vp, C_)), np.zeros((maxT, C_))
    encoder_backward_ref(ref_wte, ref_wpe, dout.astype(np.float64), tokens)
    dout_d = kdev.asarray(dout)
    inp_d = kdev.asarray(tokens)
    buckets = wte_buckets_upload(kdev, tokens)
    bits = []
    for _ in range(2):                                  # twice: deterministic means the same bits
        dwte, dwpe = kdev.zeros((Vp, C_)), kdev.zeros((maxT, C_))
        encoder_backward(kdev, dwte, dwpe, dout_d, inp_d, buckets=buckets)
        bits.append((kdev.to_host(dwte), kdev.to_host(dwpe)))
    errs = {"dwte": rel_err(bits[0][0], ref_wte), "dwpe": rel_err(bits[0][1], ref_wpe)}
    # timing, after compilation: the host table build, and backward (wpe + bucket wte kernels)
    t0 = time.perf_counter()
    for _ in range(10):
        wte_buckets(tokens)
    host_ms = (time.perf_counter() - t0) / 10 * 1e3
    times = {}
    for name, b in (("buckets", buckets), ("teaching", None)):
        reps = 20 if b is not None else 2
        encoder_backward(kdev, dwte, dwpe, dout_d, inp_d, buckets=b)
        kdev.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            encoder_backward(kdev, dwte, dwpe, dout_d, inp_d, buckets=b)
        kdev.synchronize()
        times[name] = (time.perf_counter() - t0) / reps * 1e3
    runs = int(kdev.to_host(buckets)[0])
    print(f"encoder buckets {dist} B={B} T={T} C={C_}: {runs} distinct tokens, worst relative error "
          f"{max(errs.values()):.2e} {errs}; backward ms per call {times}; wte_buckets on the host {host_ms:.2f} ms")
    # float64 sums, one float32 rounding per element
    assert max(errs.values()) < 1e-6
    np.testing.assert_array_equal(bits[0][0], bits[1][0])
    np.testing.assert_array_equal(bits[0][1], bits[1][1])
