"""The linear layer's fast path (llmz/fast/matmul.py) against the teaching one (llmz/kernels/matmul.py): the
bias fill (FILL_ROWS rows a thread, on words of two elements where they fit) writes the teaching kernel's bits;
the layer (cuBLAS on a GPU, the tiled product in the simulator, the one-launch column sums) matches the
teaching layer and the float64 reference."""
import numpy as np
import pytest
from test_matmul import _inputs

from helpers import NAN_BF16, assert_rounded_float32, poisoned, rand_bf16, rel_err
from llmz.bf16 import bf16_to_f32
from llmz.fast import matmul as fast
from llmz.fast.device_helpers import pair_view
from llmz.fast.matmul import bias_grid, matmul_bias_fill_kernel
from llmz.kernels import matmul as teaching
from llmz.kernels.matmul import matmul_backward_ref, matmul_forward_ref


# the bias fill: each thread writes up to FILL_ROWS = 32 rows a grid apart, one column. N = 1 and 9: fewer
# rows than one thread's 32; N = 70: three row blocks, the last thread's third row past the end; OC = 37:
# past the 32-thread block
@pytest.mark.parametrize("N", [1, 9, 70])
def test_matmul_bias_fill_kernel_writes_the_bias_into_every_row(kdev, rng, N):
    OC = 37
    bias = rng.normal(size=OC).astype(np.float32)
    out = poisoned(kdev, (N, OC))
    kdev.launch(matmul_bias_fill_kernel, bias_grid(kdev, N, OC), kdev.block_size, out, kdev.asarray(bias))
    # a copy: bit-exact (a missed element keeps its NaN)
    np.testing.assert_array_equal(kdev.to_host(out), np.broadcast_to(bias, (N, OC)))


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_matmul_bias_fill_kernel_on_paired_views_copies_the_bias_bits(kdev, rng, dtype):
    # the GPU layer's path: out and bias as words of two elements (float32 as uint64, bf16 as uint32)
    N, OC = 9, 38
    # bf16: random finite bit patterns (below 0x7F80, the exponent of inf/NaN)
    bias = rng.integers(0, 0x7F80, size=OC, dtype=np.uint16) if dtype == np.uint16 else \
        rng.normal(size=OC).astype(np.float32)
    out = kdev.asarray(np.full((N, OC), 0xFFFF, np.uint16) if dtype == np.uint16 else np.full((N, OC), np.nan,
                                                                                            np.float32))
    words = pair_view(out)
    kdev.launch(matmul_bias_fill_kernel, bias_grid(kdev, *words.shape), kdev.block_size, words,
                pair_view(kdev.asarray(bias)))
    # every row the bias's bits (a missed word keeps its poison)
    np.testing.assert_array_equal(kdev.to_host(out).view(np.uint16 if dtype == np.uint16 else np.uint32),
                                  np.broadcast_to(bias.view(np.uint16 if dtype == np.uint16 else np.uint32),
                                                  (N, OC)))


@pytest.mark.parametrize("N", [3, 40])
def test_matmul_bias_fill_kernel_on_bf16_copies_the_bias_bits(kdev, rng, N):
    # OC = 37: past the 32-thread block; N = 3: fewer rows than one thread's 32, N = 40: 2 row blocks, the
    # last thread's second row past the end
    OC = 37
    bias = rand_bf16(rng, OC)
    out = kdev.asarray(np.full((N, OC), NAN_BF16, np.uint16))
    kdev.launch(matmul_bias_fill_kernel, bias_grid(kdev, N, OC), kdev.block_size, out, kdev.asarray(bias))
    np.testing.assert_array_equal(kdev.to_host(out), np.broadcast_to(bias, (N, OC)))
    # a bf16 bias into a float32 out: its values exactly (a missed element keeps its NaN)
    out = kdev.full((N, OC), np.nan, np.float32)
    kdev.launch(matmul_bias_fill_kernel, bias_grid(kdev, N, OC), kdev.block_size, out, kdev.asarray(bias))
    np.testing.assert_array_equal(kdev.to_host(out), np.broadcast_to(bf16_to_f32(bias), (N, OC)))


def run_layers(dev, k, inp, weight, bias, dout, starts):
    """Forward and backward (dinp overwritten, dweight and dbias accumulated from starts) of k's matmul layer:
    (out, dinp, dweight, dbias) on the host."""
    out = poisoned(dev, dout.shape)
    k.matmul_forward(dev, out, dev.asarray(inp), dev.asarray(weight), dev.asarray(bias))
    dinp, dweight, dbias = poisoned(dev, inp.shape), dev.asarray(starts[0]), dev.asarray(starts[1])
    k.matmul_backward(dev, dinp, dweight, dbias, dev.asarray(dout), dev.asarray(inp), dev.asarray(weight),
                      dinp_accumulate=False)
    return [dev.to_host(a) for a in (out, dinp, dweight, dbias)]


def test_matmul_fast_layers_match_the_teaching_layers(kdev, fdev, rng, launched):
    # (2,3,20) -> 18: OC even, so the fill goes on words and the bias gradient through the paired column sum
    inp, weight, bias, dout = (a.astype(np.float32) for a in _inputs(rng, 2, 3, 20, 18))
    starts = [rng.normal(size=s).astype(np.float32) for s in ((18, 20), 18)]
    names = launched(fdev)
    got = run_layers(fdev, fast, inp, weight, bias, dout, starts)
    assert "matmul_bias_fill_kernel" in names and "column_sum_pairs_kernel" in names
    want = run_layers(kdev, teaching, inp, weight, bias, dout, starts)
    # in the simulator the same tiled products, the bias the same bits, the bias gradient's float64 sum in
    # another order: an ulp at most; on a GPU cuBLAS (TF32) against the tiled kernel: ~1e-3
    tol = 5e-3 if fdev.matmul == "cublas" else 1e-6
    for what, f, t in zip(("out", "dinp", "dweight", "dbias"), got, want):
        assert rel_err(f, t) < tol, what


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tf32", "fp32"])
@pytest.mark.parametrize("B,T,C,OC", [(4, 1024, 768, 768), (4, 1024, 768, 3 * 768), (4, 1024, 768, 50304)])
def test_matmul_fast_layers_match_float64_reference_at_gpt2_size(fdev, fdev_exact, rng, which, B, T, C, OC):
    dev = fdev if which == "tf32" else fdev_exact
    inp, weight, bias, dout = (x.astype(np.float32) for x in _inputs(rng, B, T, C, OC))
    out, dinp, dweight, dbias = run_layers(dev, fast, inp, weight, bias, dout,
                                           [np.zeros((OC, C), np.float32), np.zeros(OC, np.float32)])
    ref = np.empty((B, T, OC))
    matmul_forward_ref(ref, *(x.astype(np.float64) for x in (inp, weight, bias)))
    r = [np.zeros(x.shape) for x in (inp, weight, bias)]
    matmul_backward_ref(*r, *(x.astype(np.float64) for x in (dout, inp, weight)))
    err = {"out": rel_err(out, ref), "dinp": rel_err(dinp, r[0]), "dweight": rel_err(dweight, r[1]),
           "dbias": rel_err(dbias, r[2])}
    print(f"matmul fast ({which}) B={B} T={T} C={C} OC={OC}: relative error vs float64 {err}")
    # fp32: as the tiled kernel; TF32: 10-bit mantissas in the products (the bias sums stay exact)
    assert max(err.values()) < (1e-5 if which == "fp32" else 5e-3)
    assert err["dbias"] < 1e-6


@pytest.mark.gpu
def test_matmul_bias_fill_bf16_kernel_matches_float32_kernel_at_gpt2_size(kdev, rng):
    N, OC = 16384, 2304
    bias = rand_bf16(rng, OC)
    out, out32 = kdev.asarray(np.full((N, OC), NAN_BF16, np.uint16)), kdev.full((N, OC), np.nan, np.float32)
    kdev.launch(matmul_bias_fill_kernel, bias_grid(kdev, N, OC), kdev.block_size, pair_view(out),
                pair_view(kdev.asarray(bias)))
    kdev.launch(matmul_bias_fill_kernel, bias_grid(kdev, N, OC), kdev.block_size, out32,
                kdev.asarray(bf16_to_f32(bias)))
    assert_rounded_float32("matmul bias fill (pairs)", kdev.to_host(out), kdev.to_host(out32), rel=0.0)
