"""Encoder: the kernels against the NumPy reference, the reference against finite differences."""
import numpy as np
import pytest

from helpers import finite_diff, poisoned, rel_err
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
