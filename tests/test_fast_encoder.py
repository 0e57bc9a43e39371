"""The encoder's fast wte backward (llmz/fast/encoder.py: the positions sorted by token, a block per token)
against the reference and the teaching kernel (llmz/kernels/encoder.py), and its bucket table."""
import time

import numpy as np
import pytest
from test_encoder import MAXT, TOKENS, VP, C, forward64

from helpers import assert_within_one_step, rand_bf16, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.fast.encoder import (
    encoder_backward,
    encoder_backward_wte_bucket_kernel,
    wte_buckets,
    wte_buckets_upload,
    wte_table_size,
)
from llmz.kernels import encoder as teaching
from llmz.kernels.encoder import encoder_backward_ref


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


def run_backward(fdev, dout, inp, dwte0, dwpe0, buckets):
    dwte = fdev.asarray(dwte0, np.float32)
    dwpe = fdev.asarray(dwpe0, np.float32)
    encoder_backward(fdev, dwte, dwpe, fdev.asarray(dout), fdev.asarray(inp), buckets=buckets)
    return fdev.to_host(dwte), fdev.to_host(dwpe)


# TOKENS: repeats within and across rows, unused rows. (4,8) of 5 ids in a 9-row table with C=45: about six
# repeats per id, ids 5..8 unused, C above the simulator's 32-thread block (two channel blocks per token)
@pytest.mark.parametrize("tokens, vp, c", [(TOKENS, VP, C), ("random", 9, 45)])
def test_encoder_backward_bucket_kernel_matches_reference_and_accumulates(fdev, rng, tokens, vp, c):
    if isinstance(tokens, str):
        tokens = rng.integers(0, 5, size=(4, 8)).astype(np.int32)
    B, T = tokens.shape
    dout = rng.normal(size=(B, T, c)).astype(np.float32)
    # backward accumulates: start from random non-zero values
    dwte0, dwpe0 = rng.normal(size=(vp, c)), rng.normal(size=(MAXT + T, c))
    buckets = wte_buckets_upload(fdev, tokens)
    dwte, dwpe = run_backward(fdev, dout, tokens, dwte0, dwpe0, buckets)
    ref_wte, ref_wpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(ref_wte, ref_wpe, dout.astype(np.float64), tokens)
    # a float64 sum per (token, channel), one float32 rounding of start + sum: about an ulp
    assert rel_err(dwte, ref_wte) < 1e-6
    assert rel_err(dwpe, ref_wpe) < 1e-6
    # rows of unused tokens are untouched
    unused = sorted(set(range(vp)) - set(tokens.reshape(-1).tolist()))
    np.testing.assert_array_equal(dwte[unused], dwte0[unused].astype(np.float32))
    # the same bits on a second run
    again = run_backward(fdev, dout, tokens, dwte0, dwpe0, buckets)
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


def test_encoder_backward_bucket_kernel_on_bf16_matches_the_bf16_reference(fdev, rng):
    tokens = rng.integers(0, 5, size=(4, 8)).astype(np.int32)        # about six repeats per id, 5..8 unused
    B, T = tokens.shape
    vp, c = 9, 45                                                     # C above the 32-thread block
    dout = rand_bf16(rng, (B, T, c))
    dwte0, dwpe0 = rand_bf16(rng, (vp, c)), rand_bf16(rng, (MAXT + T, c))
    buckets = wte_buckets_upload(fdev, tokens)
    runs = []
    for _ in range(2):                                                # twice: the same bits
        dwte, dwpe = fdev.asarray(dwte0), fdev.asarray(dwpe0)
        encoder_backward(fdev, dwte, dwpe, fdev.asarray(dout), fdev.asarray(tokens), buckets=buckets)
        runs.append((fdev.to_host(dwte), fdev.to_host(dwpe)))
    ref_wte, ref_wpe = dwte0.copy(), dwpe0.copy()
    encoder_backward_ref(ref_wte, ref_wpe, dout, tokens)
    # each (token, channel) summed in its own order, then one rounding: within one bf16 step of the
    # reference (1e-5 absolute: float32 rounding of ~10 terms of size ~1 where the sum cancels)
    assert_within_one_step(runs[0][0], ref_wte, atol=1e-5)
    assert_within_one_step(runs[0][1], ref_wpe, atol=1e-5)
    # bf16 rounding of the float32 kernel's result, bit for bit
    dwte32, dwpe32 = fdev.asarray(bf16_to_f32(dwte0)), fdev.asarray(bf16_to_f32(dwpe0))
    encoder_backward(fdev, dwte32, dwpe32, fdev.asarray(bf16_to_f32(dout)), fdev.asarray(tokens), buckets=buckets)
    np.testing.assert_array_equal(runs[0][0], f32_to_bf16(fdev.to_host(dwte32)))
    np.testing.assert_array_equal(runs[0][1], f32_to_bf16(fdev.to_host(dwpe32)))
    unused = sorted(set(range(vp)) - set(tokens.reshape(-1).tolist()))
    np.testing.assert_array_equal(runs[0][0][unused], dwte0[unused])
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_encoder_bucket_kernel_matches_float64_reference_at_gpt2_size(fdev, rng, dist):
    B, T, C_, Vp, maxT = 16, 1024, 768, 50304, 1024
    if dist == "uniform":                               # random tokens: a few repeats per id
        tokens = rng.integers(0, 50257, size=(B, T))
    else:                                               # text-like: the commonest ids repeat hundreds of times
        tokens = np.minimum(rng.zipf(1.2, size=(B, T)) - 1, 50256)
    tokens = tokens.astype(np.int32)
    dout = rng.normal(size=(B, T, C_)).astype(np.float32)
    ref_wte, ref_wpe = np.zeros((Vp, C_)), np.zeros((maxT, C_))
    encoder_backward_ref(ref_wte, ref_wpe, dout.astype(np.float64), tokens)
    dout_d = fdev.asarray(dout)
    inp_d = fdev.asarray(tokens)
    buckets = wte_buckets_upload(fdev, tokens)
    bits = []
    for _ in range(2):                                  # twice: deterministic means the same bits
        dwte, dwpe = fdev.zeros((Vp, C_)), fdev.zeros((maxT, C_))
        encoder_backward(fdev, dwte, dwpe, dout_d, inp_d, buckets=buckets)
        bits.append((fdev.to_host(dwte), fdev.to_host(dwpe)))
    errs = {"dwte": rel_err(bits[0][0], ref_wte), "dwpe": rel_err(bits[0][1], ref_wpe)}
    # timing, after compilation: the host table build, and backward (wpe + bucket wte kernels)
    t0 = time.perf_counter()
    for _ in range(10):
        wte_buckets(tokens)
    host_ms = (time.perf_counter() - t0) / 10 * 1e3
    times = {}
    for name, b in (("buckets", buckets), ("teaching", None)):
        reps = 20 if b is not None else 2
        encoder_backward(fdev, dwte, dwpe, dout_d, inp_d, buckets=b)
        fdev.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            encoder_backward(fdev, dwte, dwpe, dout_d, inp_d, buckets=b)
        fdev.synchronize()
        times[name] = (time.perf_counter() - t0) / reps * 1e3
    runs = int(fdev.to_host(buckets)[0])
    print(f"encoder buckets {dist} B={B} T={T} C={C_}: {runs} distinct tokens, worst relative error "
          f"{max(errs.values()):.2e} {errs}; backward ms per call {times}; wte_buckets on the host {host_ms:.2f} ms")
    # float64 sums, one float32 rounding per element
    assert max(errs.values()) < 1e-6
    np.testing.assert_array_equal(bits[0][0], bits[1][0])
    np.testing.assert_array_equal(bits[0][1], bits[1][1])


@pytest.mark.gpu
def test_encoder_bucket_kernel_on_bf16_is_the_rounded_float32_kernel_at_gpt2_size(fdev, rng):
    from helpers import assert_rounded_float32
    B, T, C_, Vp, maxT = 16, 1024, 768, 50304, 1024
    tokens = rng.integers(0, 50257, size=(B, T)).astype(np.int32)
    tokens[1, :16] = tokens[0, :16]                                   # repeats across the batch
    dout = rand_bf16(rng, (B, T, C_))
    dwte0, dwpe0 = rand_bf16(rng, (Vp, C_), 1e-2), rand_bf16(rng, (maxT, C_), 1e-2)
    buckets, inp = wte_buckets_upload(fdev, tokens), fdev.asarray(tokens)
    dwte, dwpe = fdev.asarray(dwte0), fdev.asarray(dwpe0)
    encoder_backward(fdev, dwte, dwpe, fdev.asarray(dout), inp, buckets=buckets)
    dwte32, dwpe32 = fdev.asarray(bf16_to_f32(dwte0)), fdev.asarray(bf16_to_f32(dwpe0))
    encoder_backward(fdev, dwte32, dwpe32, fdev.asarray(bf16_to_f32(dout)), inp, buckets=buckets)
    # one rounding per (token, channel)
    assert_rounded_float32("encoder backward dwte (buckets)", fdev.to_host(dwte), fdev.to_host(dwte32))
    assert_rounded_float32("encoder backward dwpe", fdev.to_host(dwpe), fdev.to_host(dwpe32))


@pytest.mark.gpu
def test_encoder_fast_backward_is_within_k_roundings_of_the_teaching_kernel_at_gpt2_size(kdev, fdev, rng):
    # float32: the teaching kernel rounds after each of a token's k adds, the bucket kernel once, so the two
    # differ by at most k + 1 float32 roundings (half an ulp: <= 2^-24 of the value) of partial sums no larger
    # than |start| + sum |dout|; dwpe: the same kernel, the same bits
    B, T, C_, Vp, maxT = 16, 1024, 768, 50304, 1024
    tokens = np.minimum(rng.zipf(1.2, size=(B, T)) - 1, 50256).astype(np.int32)     # text-like repeats
    dout = rng.normal(size=(B, T, C_)).astype(np.float32)
    starts = [rng.normal(size=s).astype(np.float32) * 1e-2 for s in ((Vp, C_), (maxT, C_))]
    got = {}
    for name, dev, k in (("teaching", kdev, teaching), ("fast", fdev, None)):
        dwte, dwpe = (dev.asarray(s) for s in starts)
        if k is None:
            encoder_backward(dev, dwte, dwpe, dev.asarray(dout), dev.asarray(tokens), wte_buckets_upload(dev, tokens))
        else:
            k.encoder_backward(dev, dwte, dwpe, dev.asarray(dout), dev.asarray(tokens))
        got[name] = dev.to_host(dwte), dev.to_host(dwpe)
    np.testing.assert_array_equal(got["fast"][1], got["teaching"][1])
    counts = np.bincount(tokens.reshape(-1), minlength=Vp)[:, None]
    size = np.abs(starts[0]).astype(np.float64)
    np.add.at(size, tokens.reshape(-1), np.abs(dout).reshape(-1, C_))
    err = np.abs(got["fast"][0].astype(np.float64) - got["teaching"][0])
    bound = (counts + 1) * size * 2.0 ** -24
    print(f"encoder dwte fast vs teaching: worst |diff| / (k |terms| 2^-24) {np.max(err / np.maximum(bound, 1e-300)):.3f}; "
          f"{np.mean(err == 0):.4%} bit-identical; most repeats k = {counts.max()}")
    assert np.all(err <= bound)
