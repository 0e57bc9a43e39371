"""Encoder (llmz/kernels/encoder.py, the teaching kernels): the kernels against the NumPy reference, the
reference against finite differences, bf16 storage. The fast wte backward: tests/test_fast_encoder.py."""
import numpy as np
import pytest

from helpers import (
    NAN_BF16,
    assert_rounded_float32,
    assert_within_one_step,
    finite_diff,
    poisoned,
    poisoned_bf16,
    rand_bf16,
    rel_err,
)
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.encoder import encoder_backward, encoder_backward_ref, encoder_forward, encoder_forward_ref

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


# ---- bf16 storage ----------------------------------------------------------------------------------
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
def test_encoder_bf16_kernels_match_float32_kernels_at_gpt2_size(kdev, rng):
    B, T, C_, Vp, maxT = 16, 1024, 768, 50304, 1024
    tokens = rng.integers(0, 50257, size=(B, T)).astype(np.int32)
    tokens[1, :16] = tokens[0, :16]                                   # repeats across the batch
    wte, wpe, dout = rand_bf16(rng, (Vp, C_)), rand_bf16(rng, (maxT, C_)), rand_bf16(rng, (B, T, C_))
    inp = kdev.asarray(tokens)
    out, out32 = poisoned_bf16(kdev, (B, T, C_)), kdev.full((B, T, C_), np.nan, np.float32)
    encoder_forward(kdev, out, inp, kdev.asarray(wte), kdev.asarray(wpe))
    encoder_forward(kdev, out32, inp, kdev.asarray(bf16_to_f32(wte)), kdev.asarray(bf16_to_f32(wpe)))
    assert_rounded_float32("encoder forward", kdev.to_host(out), kdev.to_host(out32))
    dwte0, dwpe0 = rand_bf16(rng, (Vp, C_), 1e-2), rand_bf16(rng, (maxT, C_), 1e-2)
    dwte, dwpe = kdev.asarray(dwte0), kdev.asarray(dwpe0)
    encoder_backward(kdev, dwte, dwpe, kdev.asarray(dout), inp)
    dwte32, dwpe32 = kdev.asarray(bf16_to_f32(dwte0)), kdev.asarray(bf16_to_f32(dwpe0))
    encoder_backward(kdev, dwte32, dwpe32, kdev.asarray(bf16_to_f32(dout)), inp)
    assert_rounded_float32("encoder backward dwpe", kdev.to_host(dwpe), kdev.to_host(dwpe32))
    # the teaching wte kernel rounds after every add: a token seen k times carries up to k roundings, each
    # within 2^-8 of a partial sum, itself at most |start| + sum |dout| over the token's positions
    dwte, dwte32 = kdev.to_host(dwte), kdev.to_host(dwte32)
    counts = np.bincount(tokens.reshape(-1), minlength=Vp)[:, None]
    size = np.abs(bf16_to_f32(dwte0)).astype(np.float64)
    np.add.at(size, tokens.reshape(-1), np.abs(bf16_to_f32(dout)).reshape(-1, C_))
    err = np.abs(bf16_to_f32(dwte).astype(np.float64) - dwte32)
    seen = counts[:, 0] > 0
    ratio = err[seen] / (counts[seen] * size[seen])
    print(f"encoder backward dwte (teaching): worst error / (k |terms|) {ratio.max():.3e} (bound {2.0 ** -8:.3e}); "
          f"most repeats k = {counts.max()}")
    assert ratio.max() <= 2.0 ** -8
    np.testing.assert_array_equal(dwte[~seen], dwte0[~seen])         # unused rows untouched
