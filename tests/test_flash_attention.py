"""Flash attention: the NumPy reference against the plain attention reference and finite differences, the
teaching kernels (simulator or GPU) against the reference, and on a GPU the tensor-core kernels
(llmz.fast.flash_attention, llmz.fast.mma) against float64 and against the teaching kernels."""
import numpy as np
import pytest
from numba import cuda

from helpers import NAN_BF16, assert_within_one_step, finite_diff, poisoned, rand_bf16, rel_err
from llmz import fast, kernels
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.fast import flash_attention as fa
from llmz.kernels.attention import attention_backward_ref, attention_forward_ref
from llmz.kernels.flash_attention import (
    BLOCK,
    flash_attention_backward_ref,
    flash_attention_forward_ref,
)


def plain(inp, dout, NH):
    """The plain attention reference (the whole T x T softmax), float64: out, lse, dinp."""
    B, T, C3 = inp.shape
    out, preatt, att = np.empty((B, T, C3 // 3)), np.empty((B, NH, T, T)), np.empty((B, NH, T, T))
    attention_forward_ref(out, preatt, att, inp, NH)
    # lse from the scaled scores on and below the diagonal
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), preatt, -np.inf)
    lse = np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1)) + s.max(-1)
    dinp = np.zeros(inp.shape)
    attention_backward_ref(dinp, np.empty(att.shape), np.empty(att.shape), dout, inp, att, NH)
    return out, lse, dinp


def flash_ref(inp, dout, NH, dinp0=None, accumulate=True):
    """The flash reference: out, lse, dinp (accumulated onto dinp0, or overwriting)."""
    B, T, C3 = inp.shape
    out, lse = np.empty((B, T, C3 // 3)), np.empty((B, NH, T))
    flash_attention_forward_ref(out, lse, inp, NH)
    dinp = np.zeros(inp.shape) if dinp0 is None else dinp0.copy()
    flash_attention_backward_ref(dinp, dout, inp, out, lse, NH, accumulate)
    return out, lse, dinp


# ---- the reference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 17, 1000, 1030])
def test_flash_reference_matches_plain_attention_reference(rng, T):
    # T past the reference's 64-key tile (1000, 1030: the last tile partial), and within one tile (1, 17)
    B, NH, hs = 2, 2, 8
    inp = rng.normal(size=(B, T, 3 * NH * hs))
    dout = rng.normal(size=(B, T, NH * hs))
    want = plain(inp, dout, NH)
    got = flash_ref(inp, dout, NH)
    # float64, the same math in another order (online softmax, tiled sums): rounding only
    for name, g, w in zip(("out", "lse", "dinp"), got, want):
        assert rel_err(g, w) < 1e-12, name


def test_flash_reference_backward_matches_finite_differences(rng):
    B, T, NH, hs = 1, 7, 2, 3
    inp = rng.normal(size=(B, T, 3 * NH * hs))
    dout = rng.normal(size=(B, T, NH * hs))
    _, _, dinp = flash_ref(inp, dout, NH)

    def forward(x):
        out, lse = np.empty((B, T, NH * hs)), np.empty((B, NH, T))
        flash_attention_forward_ref(out, lse, x, NH)
        return out
    idx, g = finite_diff(forward, inp, dout)
    # central differences in float64: truncation ~eps^2, rounding ~1e-16/eps
    assert rel_err(dinp.reshape(-1)[idx], g) < 1e-6


def test_flash_reference_overwrites_dinp_when_asked(rng):
    B, T, NH, hs = 1, 9, 2, 4
    inp, dout = rng.normal(size=(B, T, 3 * NH * hs)), rng.normal(size=(B, T, NH * hs))
    dinp0 = rng.normal(size=inp.shape)
    acc = flash_ref(inp, dout, NH, dinp0)[2]
    over = flash_ref(inp, dout, NH, np.full(inp.shape, np.nan), accumulate=False)[2]
    assert rel_err(acc - dinp0, over) < 1e-14


# ---- the teaching kernels (simulator on CI) -------------------------------------------------------------
def run_kernels(dev, inp, dout, NH, dinp0=None, accumulate=True, dtype=np.float32):
    """Flash forward + backward (the device's kernel set) on `dev` with values stored as `dtype`, on poisoned outputs:
    out, lse, dinp on the host."""
    B, T, C3 = inp.shape
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    def poison(shape, dt):
        return dev.full(shape, NAN_BF16, dt) if dt == np.uint16 else poisoned(dev, shape, dt)
    out, lse = poison((B, T, C3 // 3), dtype), poison((B, NH, T), lse_dtype)
    x = dev.asarray(inp, dtype)
    k = fast if dev.fast else kernels            # the layer functions of the device's kernel set
    k.flash_attention_forward(dev, out, lse, x, NH)
    dinp = poison(inp.shape, dtype) if dinp0 is None else dev.asarray(dinp0, dtype)
    k.flash_attention_backward(dev, dinp, dev.asarray(dout, dtype), x, out, lse, NH, accumulate)
    return dev.to_host(out), dev.to_host(lse), dev.to_host(dinp)


# T: one row; a partial tile; two whole tiles and one row (the causal mask on tile edges, a last tile of 1)
@pytest.mark.parametrize("T", [1, 17, 2 * BLOCK + 1])
def test_flash_kernels_match_reference(kdev, rng, T):
    B, NH, hs = 2, 2, 4
    inp = rng.normal(size=(B, T, 3 * NH * hs))
    dout = rng.normal(size=(B, T, NH * hs))
    dinp0 = rng.normal(size=inp.shape)                       # backward accumulates: start non-zero
    got = run_kernels(kdev, inp, dout, NH, dinp0)
    # the reference on the float32-rounded inputs the kernels saw
    want = flash_ref(*(x.astype(np.float32).astype(np.float64) for x in (inp, dout)), NH,
                     dinp0.astype(np.float32).astype(np.float64))
    # float64 sums inside, float32 storage of inputs and results: a few float32 ulps
    for name, g, w in zip(("out", "lse", "dinp"), got, want):
        assert rel_err(g, w) < 1e-6, name


def test_flash_kernels_in_float64_match_reference_to_rounding(kdev, rng):
    if kdev.kind == "gpu":
        pytest.skip("float64 storage is the cpu and sim paths' precision")
    B, T, NH, hs = 1, 20, 2, 4
    inp, dout = rng.normal(size=(B, T, 3 * NH * hs)), rng.normal(size=(B, T, NH * hs))
    got = run_kernels(kdev, inp, dout, NH, accumulate=False, dtype=np.float64)
    want = flash_ref(inp, dout, NH)
    for name, g, w in zip(("out", "lse", "dinp"), got, want):
        assert rel_err(g, w) < 1e-13, name


def test_flash_kernels_on_bf16_are_within_one_bf16_step_of_the_reference(kdev, rng):
    B, T, NH, hs = 1, 17, 2, 4
    inp, dout = rand_bf16(rng, (B, T, 3 * NH * hs)), rand_bf16(rng, (B, T, NH * hs))
    out, lse, dinp = run_kernels(kdev, inp, dout, NH, accumulate=False, dtype=np.uint16)
    # the reference's bf16 path: the same widened inputs, results rounded once; the kernels sum in float64,
    # the reference in float32/float64 in another order, so the two roundings can land one step apart
    rout, rlse = np.empty(out.shape, np.uint16), np.empty(lse.shape, np.float32)
    flash_attention_forward_ref(rout, rlse, inp, NH)
    assert_within_one_step(out, rout)
    assert rel_err(lse, rlse) < 1e-6
    # backward from the kernels' own out (the rowsum D reads it), overwriting
    rdinp = np.empty(inp.shape, np.uint16)
    flash_attention_backward_ref(rdinp, dout, inp, out, lse, NH, accumulate=False)
    # where a gradient sums terms that cancel, float32 rounding of the terms moves it more than a step
    assert_within_one_step(dinp, rdinp, atol=1e-3)
    assert rel_err(bf16_to_f32(dinp), bf16_to_f32(rdinp)) < 2 ** -8


@pytest.mark.parametrize("t", [BLOCK - 1, BLOCK])
def test_flash_kernels_output_at_t_does_not_depend_on_later_positions(kdev, rng, t):
    # t: the last row of the first tile and the first row of the second (the diagonal tile's mask edge)
    B, T, NH, hs = 1, 2 * BLOCK, 2, 4
    inp = rng.normal(size=(B, T, 3 * NH * hs))
    dout = rng.normal(size=(B, T, NH * hs))
    later = inp.copy()
    later[:, t + 1:] = rng.normal(size=later[:, t + 1:].shape) * 10
    a, b = run_kernels(kdev, inp, dout, NH), run_kernels(kdev, later, dout, NH)
    # positions <= t see exactly the same numbers in the same order: bit-identical out and lse
    assert np.array_equal(a[0][:, :t + 1], b[0][:, :t + 1])
    assert np.array_equal(a[1][..., :t + 1], b[1][..., :t + 1])
    assert not np.allclose(a[0][:, t + 1:], b[0][:, t + 1:])


# ---- on a GPU: the teaching kernels at long T ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1000, 1030])
def test_flash_teaching_kernels_match_reference_at_long_T(kdev, rng, T):
    B, NH, hs = 2, 3, 64
    inp = rng.normal(size=(B, T, 3 * NH * hs))
    dout = rng.normal(size=(B, T, NH * hs))
    got = run_kernels(kdev, inp, dout, NH, accumulate=False)
    want = flash_ref(*(x.astype(np.float32).astype(np.float64) for x in (inp, dout)), NH)
    for name, g, w in zip(("out", "lse", "dinp"), got, want):
        assert rel_err(g, w) < 1e-6, name


# ---- the model and the memory formula with --attention flash --------------------------------------------
def test_model_step_with_flash_attention_matches_direct_attention(rng):
    # a tiny model's forward and backward on the simulator (or GPU) teaching kernels with --attention flash,
    # against the float64 references of --attention direct (the plain math; the simulator is too slow to
    # run the direct kernels beside it in CI time)
    from test_model import TINY, random_params, run

    from llmz.device import Device
    from llmz.layout import Layout
    B, T = 1, 8
    flat = random_params(Layout(TINY, 1), rng)
    x, y = rng.integers(0, TINY.vocab_size, (B, T)), rng.integers(0, TINY.vocab_size, (B, T))
    dev = Device("gpu" if _have_gpu() else "sim", np.float32, matmul="numba", attention="flash")
    loss_f, logits_f, grads_f, layout = run(dev, TINY, flat.astype(np.float32), x, y, B, T)
    loss_d, logits_d, grads_d, _ = run(Device("cpu", np.float64, attention="direct"), TINY, flat, x, y, B, T)
    # float32 kernels against the float64 reference: rounding of sums over at most 4C = 32 terms
    assert abs(loss_f - loss_d) / abs(loss_d) < 1e-5
    assert rel_err(logits_f[..., :TINY.vocab_size], logits_d[..., :TINY.vocab_size]) < 1e-5
    gf, gd = layout.views(grads_f), layout.views(grads_d)
    for b in range(len(layout.buckets)):
        for name in gd[b]:
            assert rel_err(gf[b][name], gd[b][name]) < 1e-4, (layout.buckets[b].name, name)


def _have_gpu():
    from conftest import HAVE_GPU
    return HAVE_GPU


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_flash_activations_drop_the_square_buffers_and_match_the_memory_formula(dtype):
    from llmz.config import preset
    from llmz.device import Device
    from llmz.memory import activation_elements
    from llmz.model import Activations
    cfg, B, T = preset("d2", vocab_size=300), 2, 64
    value_bytes = np.dtype(dtype).itemsize
    sizes = {}
    for attention in ("direct", "flash"):
        acts = Activations(cfg, Device("cpu", dtype, attention=attention), B, T)
        values, stats = activation_elements(cfg, B, T, flash=attention == "flash")
        # predicted = allocated, to the byte
        assert acts.nbytes() == value_bytes * values + 4 * stats, attention
        sizes[attention] = acts.nbytes()
        assert hasattr(acts, "att") == (attention != "flash") and hasattr(acts, "lse") == (attention == "flash")
    # flash saves att (L,B,NH,T,T) and preatt, dpreatt, datt (B,NH,T,T), and keeps lse (L,B,NH,T) fp32
    L, NH = cfg.num_layers, cfg.num_heads
    saved = value_bytes * (L + 3) * B * NH * T * T - 4 * L * B * NH * T
    assert sizes["direct"] - sizes["flash"] == saved


def test_training_with_flash_attention_on_cpu_follows_direct_and_reports_memory(tmp_path):
    # llmz.train end to end (the NumPy references on cpu): the loss curve of --attention flash is direct's,
    # and the memory report's prediction is what was allocated
    from test_bf16_train import worker
    (direct,), _ = worker(tmp_path / "direct", "-b", 2, "--steps", 3, "--attention", "direct")
    (flash,), _ = worker(tmp_path / "flash", "-b", 2, "--steps", 3, "--attention", "flash")
    np.testing.assert_allclose(flash["losses"], direct["losses"], rtol=1e-5)
    assert flash["memory"]["predicted"] == flash["memory"]["measured"]
    assert flash["memory"]["measured"]["activations"] < direct["memory"]["measured"]["activations"]


# ---- on a GPU: the tensor-core kernels (llmz.fast) ------------------------------------------------------
# bf16 tolerances: bf16 inputs, fp32 accumulation, P and dS rounded to bf16 for their products (as
# FlashAttention-2 does), outputs rounded once: norm-wise relative error of out < 1e-2, of dq, dk, dv < 2e-2,
# lse (fp32) within 1e-2 absolute. (tools/flash_check.py runs the same checks and the timings in one go.)
FAST_TOL = {"out": 1e-2, "lse": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}


def _fast_dev():
    from llmz.device import Device
    return Device("gpu", np.uint16, kernel_set="fast", attention="flash")


def _bf16_ref(inp, dout, NH):
    """The float64 flash reference on bf16 inputs' values: out, lse, dinp."""
    return flash_ref(bf16_to_f32(inp).astype(np.float64), bf16_to_f32(dout).astype(np.float64), NH)


def _errors(got, want, C):
    out, lse, dinp = got
    errs = {"out": rel_err(bf16_to_f32(out), want[0]), "lse": float(np.max(np.abs(lse - want[1])))}
    d = bf16_to_f32(dinp).astype(np.float64)
    scale = 1e-3 * np.linalg.norm(want[2])
    for i, part in enumerate(("dq", "dk", "dv")):
        # relative to the part's norm, or to a thousandth of the whole gradient's where the part is ~0 (T=1:
        # the one softmax weight is 1, so dq = dk = 0 exactly, and bf16 rounding leaves ~1e-7 there)
        x, w = d[..., i * C:(i + 1) * C], want[2][..., i * C:(i + 1) * C]
        errs[part] = float(np.linalg.norm(x - w) / max(np.linalg.norm(w), scale))
    return errs


@pytest.mark.gpu
def test_mma_tile_matches_float64_and_pack_rounds_to_nearest(rng):
    from numba import cuda

    from llmz.bf16 import f32_to_bf16
    from llmz.fast.mma import mma_tile_kernel
    A, B = rand_bf16(rng, (16, 16)), rand_bf16(rng, (16, 8))
    C = rng.normal(size=(16, 8)).astype(np.float32)
    d, packed = cuda.device_array((16, 8), np.float32), cuda.device_array((16, 4), np.uint32)
    mma_tile_kernel[1, 32](d, packed, cuda.to_device(A.view(np.uint32)),
                           cuda.to_device(np.ascontiguousarray(B.T).view(np.uint32)), cuda.to_device(C))
    got = d.copy_to_host()
    want = bf16_to_f32(A).astype(np.float64) @ bf16_to_f32(B).astype(np.float64) + C
    # 16 exact bf16 products summed in fp32: a few fp32 ulps
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))
    assert np.array_equal(packed.copy_to_host(), f32_to_bf16(got).view(np.uint32))


@pytest.mark.gpu
def test_fast_flash_matches_float64_and_teaching_kernels_and_repeats_bit_for_bit(kdev, rng):
    from llmz.device import Device
    B, T, NH, hs = 4, 1024, 12, 64
    C = NH * hs
    inp, dout = rand_bf16(rng, (B, T, 3 * C)), rand_bf16(rng, (B, T, NH * hs))
    want = _bf16_ref(inp, dout, NH)
    fast = _fast_dev()
    got = run_kernels(fast, inp, dout, NH, accumulate=False, dtype=np.uint16)
    errs = _errors(got, want, C)
    print(f"fast flash vs float64: {errs}")
    assert all(errs[k] < FAST_TOL[k] for k in errs), errs
    again = run_kernels(fast, inp, dout, NH, accumulate=False, dtype=np.uint16)
    assert all(np.array_equal(x, y) for x, y in zip(got, again))
    teach = Device("gpu", np.uint16, kernel_set="teaching", attention="flash")
    tgot = run_kernels(teach, inp, dout, NH, accumulate=False, dtype=np.uint16)
    terrs = _errors(got, (bf16_to_f32(tgot[0]), tgot[1], bf16_to_f32(tgot[2])), C)
    print(f"fast flash vs teaching flash: {terrs}")
    assert all(terrs[k] < FAST_TOL[k] for k in terrs), terrs


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 65, 1000, 1030])
def test_fast_flash_masks_and_partial_tiles(rng, T):
    B, NH, hs = 2, 3, 64
    C = NH * hs
    inp, dout = rand_bf16(rng, (B, T, 3 * C)), rand_bf16(rng, (B, T, C))
    dinp0 = rand_bf16(rng, (B, T, 3 * C))
    got = run_kernels(_fast_dev(), inp, dout, NH, dinp0, accumulate=True, dtype=np.uint16)
    want = _bf16_ref(inp, dout, NH)
    got = (got[0], got[1], f32_to_bf16(bf16_to_f32(got[2]) - bf16_to_f32(dinp0)))    # what was added
    errs = _errors(got, want, C)
    assert all(errs[k] < FAST_TOL[k] for k in errs), errs


# ---- the cp.async + ldmatrix data movement of dev/flash_attention.py's versions 2-4, emulated in NumPy ------
# The simulator cannot run inline PTX, so the schemes are checked here: which thread copies which 16 bytes of
# a tile into which shared slot, which row address each lane gives ldmatrix (llmz.fast.mma's *_lane
# functions, the ones the kernels call) and what each lane receives (the PTX ISA's ldmatrix semantics), and
# that those registers, as mma fragments (llmz.fast.mma's drawing), make the products the kernels need.
PAD = 36                    # the kernels' shared row: 32 words of a head's row + 4


def _words_to_f64(w):
    """uint32 words of bf16 pairs -> float64 (..., 2)."""
    return bf16_to_f32(np.ascontiguousarray(w, np.uint32).view(np.uint16).reshape(*np.shape(w), 2)).astype(
        np.float64)


def _ldmatrix(smem, addr, trans):
    """ldmatrix .x4 (.trans) over the shared words `smem`, lane l giving word address addr[l]: (32, 4) words."""
    halves = smem.view(np.uint16)
    regs = np.zeros((32, 4), np.uint32)
    for i in range(4):
        m = np.array([halves[2 * addr[8 * i + r]: 2 * addr[8 * i + r] + 8] for r in range(8)])   # 8 x 8 bf16
        for lane in range(32):
            g, t = lane // 4, lane % 4
            lo, hi = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
            regs[lane, i] = np.uint32(lo) | (np.uint32(hi) << np.uint32(16))
    return regs


def _mma(a, b, c):
    """mma.m16n8k16 on fragments as llmz.fast.mma draws them: a (32,4), b (32,2) words, c (32,4) -> d (32,4)."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = _words_to_f64(a[lane, 0]), _words_to_f64(a[lane, 1])
        A[g, 8 + 2 * t:10 + 2 * t], A[g + 8, 8 + 2 * t:10 + 2 * t] = _words_to_f64(a[lane, 2]), _words_to_f64(a[lane, 3])
        B[2 * t:2 * t + 2, g], B[8 + 2 * t:10 + 2 * t, g] = _words_to_f64(b[lane, 0]), _words_to_f64(b[lane, 1])
        C[g, 2 * t:2 * t + 2], C[g + 8, 2 * t:2 * t + 2] = c[lane, 0:2], c[lane, 2:4]
    D = A @ B + C
    d = np.zeros((32, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d[lane] = D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]
    return d


def _pack(x0, x1):
    """pack_bf16x2, per lane: two float arrays -> words (round to nearest)."""
    return f32_to_bf16(np.stack([x0, x1], -1)).view(np.uint32)[..., 0]


def _copy_tile(x, r0, T, nthreads):
    """The kernels' copy_tile: x (rows, 32) words -> a 64 x PAD shared tile (rows past T zero), as the cp.async
    copies of every thread and pass write it; also counts how often each (row, chunk) was written."""
    from llmz.fast.mma import tile_copy_chunk
    smem = np.full(64 * PAD, 0xDEADBEEF, np.uint32)
    written = np.zeros((64, 8), int)
    for tid in range(nthreads):
        for i in range(64 * 8 // nthreads):
            r, c = tile_copy_chunk(tid, i, nthreads)
            row = r0 + r
            smem[r * PAD + 4 * c: r * PAD + 4 * c + 4] = x[row, 4 * c:4 * c + 4] if row < T else 0
            written[r, c] += 1
    return smem, written


@pytest.mark.parametrize("nthreads", [128, 256])
def test_tile_copies_cover_every_chunk_once_and_zero_fill_past_T(rng, nthreads):
    T = 100
    x = rng.integers(0, 2**32, size=(T, 32), dtype=np.uint32)
    smem, written = _copy_tile(x, 64, T, nthreads)
    assert np.all(written == 1)
    tile = smem.reshape(64, PAD)
    assert np.array_equal(tile[:T - 64, :32], x[64:])
    assert np.all(tile[T - 64:, :32] == 0)
    assert np.all(tile[:, 32:] == 0xDEADBEEF)          # the padding is never written


def test_ldmatrix_fragments_from_row_major_tiles_make_qk_and_pv(rng):
    # One warp of the forward kernel (rows 16w.., as every warp): S = Q K^T from K's rows by ldmatrix, then
    # O = P V from V's rows by ldmatrix .trans, with the kernel's offsets, against NumPy's products.
    from llmz.fast.mma import ldmatrix_rows_lane, ldmatrix_trans_lane
    q, k, v = (rand_bf16(rng, (64, 64)) for _ in range(3))      # rows x channels, bf16 bits
    qw, kw, vw = (a.view(np.uint32) for a in (q, k, v))        # (64, 32) words
    ks, _ = _copy_tile(kw, 0, 64, 128)
    vs, _ = _copy_tile(vw, 0, 64, 128)
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    for w in range(4):
        ra, rb = 16 * w + g, 16 * w + g + 8
        # Q's A fragments as the kernel loads them: qf[4kk + i]
        qf = np.stack([qw[r, 8 * kk + c + t] for kk in range(4) for r, c in ((ra, 0), (rb, 0), (ra, 4), (rb, 4))], 1)
        s = np.zeros((32, 32))
        for kp in range(2):
            for j in range(8):
                r = _ldmatrix(ks, ldmatrix_rows_lane(lanes, PAD) + 8 * j * PAD + 16 * kp, trans=False)
                s[:, 4 * j:4 * j + 4] = _mma(qf[:, 8 * kp:8 * kp + 4], r[:, 0:2], s[:, 4 * j:4 * j + 4])
                s[:, 4 * j:4 * j + 4] = _mma(qf[:, 8 * kp + 4:8 * kp + 8], r[:, 2:4], s[:, 4 * j:4 * j + 4])
        want = bf16_to_f32(q).astype(np.float64) @ bf16_to_f32(k).astype(np.float64).T
        for j in range(8):
            assert np.allclose(s[:, 4 * j], want[ra, 8 * j + 2 * t], rtol=1e-12, atol=1e-12)
            assert np.allclose(s[:, 4 * j + 1], want[ra, 8 * j + 2 * t + 1], rtol=1e-12, atol=1e-12)
            assert np.allclose(s[:, 4 * j + 2], want[rb, 8 * j + 2 * t], rtol=1e-12, atol=1e-12)
            assert np.allclose(s[:, 4 * j + 3], want[rb, 8 * j + 2 * t + 1], rtol=1e-12, atol=1e-12)
        # P (here: any values in S's layout) packed to A fragments as the kernel does, then O = P V
        p = rng.normal(size=(32, 32))
        pf = np.stack([_pack(p[:, 8 * kk + 2 * i], p[:, 8 * kk + 2 * i + 1]) for kk in range(4) for i in range(4)], 1)
        o = np.zeros((32, 32))
        for kk in range(4):
            for jp in range(4):
                r = _ldmatrix(vs, ldmatrix_trans_lane(lanes, PAD) + 16 * kk * PAD + 8 * jp, trans=True)
                o[:, 8 * jp:8 * jp + 4] = _mma(pf[:, 4 * kk:4 * kk + 4], r[:, 0:2], o[:, 8 * jp:8 * jp + 4])
                o[:, 8 * jp + 4:8 * jp + 8] = _mma(pf[:, 4 * kk:4 * kk + 4], r[:, 2:4], o[:, 8 * jp + 4:8 * jp + 8])
        # the P matrix those registers hold: lane (g, t) has rows g, g+8 x keys 8j+2t, 8j+2t+1
        P = np.zeros((16, 64))
        pb = bf16_to_f32(f32_to_bf16(p)).astype(np.float64)
        for j in range(8):
            P[g, 8 * j + 2 * t], P[g, 8 * j + 2 * t + 1] = pb[:, 4 * j], pb[:, 4 * j + 1]
            P[g + 8, 8 * j + 2 * t], P[g + 8, 8 * j + 2 * t + 1] = pb[:, 4 * j + 2], pb[:, 4 * j + 3]
        want = P @ bf16_to_f32(v).astype(np.float64)
        for j in range(8):
            assert np.allclose(o[:, 4 * j], want[g, 8 * j + 2 * t], rtol=1e-12, atol=1e-12)
            assert np.allclose(o[:, 4 * j + 1], want[g, 8 * j + 2 * t + 1], rtol=1e-12, atol=1e-12)
            assert np.allclose(o[:, 4 * j + 2], want[g + 8, 8 * j + 2 * t], rtol=1e-12, atol=1e-12)
            assert np.allclose(o[:, 4 * j + 3], want[g + 8, 8 * j + 2 * t + 1], rtol=1e-12, atol=1e-12)


def test_ldmatrix_rows_are_conflict_free_and_16_byte_aligned():
    # each 8-lane phase of ldmatrix reads 8 rows of 16 bytes: they must cover the 32 banks once, and start on
    # 16 bytes (the kernels' tile offsets are multiples of 4 words, tiles 16-byte aligned)
    from llmz.fast.mma import ldmatrix_rows_lane, ldmatrix_trans_lane
    for lane_fn in (ldmatrix_rows_lane, ldmatrix_trans_lane):
        addr = np.array([lane_fn(lane, PAD) for lane in range(32)])
        assert np.all(addr % 4 == 0)
        for i in range(4):
            banks = (addr[8 * i:8 * i + 8, None] + np.arange(4)[None, :]) % 32
            assert len(set(banks.ravel())) == 32


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 37])
def test_cp_async_ldmatrix_and_16_byte_loads_match_numpy(rng, T):
    # llmz.fast.mma's tile path on the GPU (tile_probe_kernel) against its NumPy emulation above: cp.async's
    # slots and zero fill past T, ldmatrix .x4 and .x4.trans registers per lane, 16-byte loads
    from numba import cuda

    from llmz.fast.mma import PROBE_PAD, tile_probe_kernel
    assert PROBE_PAD == PAD
    x = rng.integers(0, 2**32, size=(64, 32), dtype=np.uint32)
    f = rng.normal(size=64).astype(np.float32)
    tile, floats = cuda.device_array(64 * PAD, np.uint32), cuda.device_array(64, np.float32)
    ldm, ldm_t, v4 = (cuda.device_array(s, np.uint32) for s in ((2, 32, 4), (2, 32, 4), (32, 4)))
    tile_probe_kernel[1, 128](tile, floats, ldm, ldm_t, v4, cuda.to_device(x), cuda.to_device(f), T)
    cuda.synchronize()
    want, _ = _copy_tile(x, 0, T, 128)
    want[want == 0xDEADBEEF] = 0xFFFFFFFF                 # the probe marks its padding so
    smem = tile.copy_to_host()
    assert np.array_equal(smem, want)
    assert np.array_equal(floats.copy_to_host(), np.where(np.arange(64) < T, f, 0))
    lanes = np.arange(32)
    from llmz.fast.mma import ldmatrix_rows_lane, ldmatrix_trans_lane
    for n in range(2):
        assert np.array_equal(ldm.copy_to_host()[n],
                              _ldmatrix(smem, ldmatrix_rows_lane(lanes, PAD) + n * (8 * PAD + 16), trans=False))
        assert np.array_equal(ldm_t.copy_to_host()[n],
                              _ldmatrix(smem, ldmatrix_trans_lane(lanes, PAD) + n * (16 * PAD + 8), trans=True))
    assert np.array_equal(v4.copy_to_host(), x.reshape(-1)[:128].reshape(32, 4))


# ---- the FlashAttention-2 steps on fragments (llmz.fast.flash_attention's device functions; no mma) ------------
# One warp, each lane holding its C fragments as the kernels do (lane 4g+t: rows g, g+8 of each row tile, columns
# 8j+2t, +1): the steps between the products, checked element by element against NumPy in the simulator on CI.
@cuda.jit(device=True)
def to_fragments(c, x, tiles, lane):
    # c[32i + 4j + e] <- x[16i + g + 8(e // 2), 8j + 2t + e % 2] (x: 16 tiles rows x 64 columns)
    for i in range(tiles):
        for j in range(8):
            for e in range(4):
                c[32 * i + 4 * j + e] = x[16 * i + lane // 4 + 8 * (e // 2), 8 * j + 2 * (lane % 4) + e % 2]


@cuda.jit(device=True)
def from_fragments(x, c, tiles, lane):
    for i in range(tiles):
        for j in range(8):
            for e in range(4):
                x[16 * i + lane // 4 + 8 * (e // 2), 8 * j + 2 * (lane % 4) + e % 2] = c[32 * i + 4 * j + e]


@cuda.jit
def forward_steps(s_io, o_io, m_io, l_io, r0, c0, T, scale_log2):
    # two row tiles (32 query rows r0.., 64 keys c0..): the causal mask where the tile reaches past a row
    # tile's first row, then online_softmax; m_io (32,) per row, l_io (32, 4) the lanes' partial sums
    lane = cuda.threadIdx.x
    s, o = cuda.local.array(64, np.float32), cuda.local.array(64, np.float32)
    m, l = cuda.local.array(4, np.float32), cuda.local.array(4, np.float32)
    to_fragments(s, s_io, 2, lane)
    to_fragments(o, o_io, 2, lane)
    for r in range(4):
        m[r], l[r] = m_io[8 * r + lane // 4], l_io[8 * r + lane // 4, lane % 4]
    for i in range(2):
        if c0 + fa.BC - 1 > r0 + 16 * i:
            fa.causal_mask(s, i, r0 + 16 * i, c0, lane, T, False, fa.NEG)
    fa.online_softmax(s, o, m, l, 2, scale_log2)
    from_fragments(s_io, s, 2, lane)
    from_fragments(o_io, o, 2, lane)
    for r in range(4):
        m_io[8 * r + lane // 4], l_io[8 * r + lane // 4, lane % 4] = m[r], l[r]


@cuda.jit
def backward_steps(s_io, dp_io, lse2, d, r0, c0, T, transposed, scale_log2):
    # one row tile (16 rows r0.. x 64 columns c0..): P = exp(S - L), the causal mask (0), dS = P (dP - D);
    # lse2 (log2 units) and d per row (16,), or per column (64,) when transposed
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    s, dp = cuda.local.array(32, np.float32), cuda.local.array(32, np.float32)
    to_fragments(s, s_io, 1, lane)
    to_fragments(dp, dp_io, 1, lane)
    for j in range(8):
        if transposed:
            fa.recompute_p(s, 4 * j, lse2[8 * j + 2 * t], lse2[8 * j + 2 * t + 1], True, scale_log2)
        else:
            fa.recompute_p(s, 4 * j, lse2[g], lse2[g + 8], False, scale_log2)
    fa.causal_mask(s, 0, r0, c0, lane, T, transposed, fa.ZERO_F)
    for j in range(8):
        if transposed:
            fa.compute_ds(dp, s, 4 * j, d[8 * j + 2 * t], d[8 * j + 2 * t + 1], True)
        else:
            fa.compute_ds(dp, s, 4 * j, d[g], d[g + 8], False)
    from_fragments(s_io, s, 1, lane)
    from_fragments(dp_io, dp, 1, lane)


@pytest.mark.parametrize("c0", [0, 64])
def test_fragment_online_softmax_and_mask_match_numpy_per_row(fdev, rng, c0):
    # rows 40..71 (two row tiles) against keys c0..c0+63: c0 = 64 cuts both row tiles along the diagonal,
    # c0 = 0 is wholly at or before the rows (no mask); T = 72
    r0, T, scale_log2 = 40, 72, np.float32(np.log2(np.e) / 8)
    S = (rng.normal(size=(32, 64)) * 8).astype(np.float32)
    O = rng.normal(size=(32, 64)).astype(np.float32)
    m0 = (rng.normal(size=32) * 8).astype(np.float32)
    l0 = rng.uniform(0.5, 2, size=(32, 4)).astype(np.float32)
    s, o, m, l = S.copy(), O.copy(), m0.copy(), l0.copy()
    forward_steps[1, 32](s, o, m, l, r0, c0, T, scale_log2)
    keys, rows = c0 + np.arange(64)[None, :], r0 + np.arange(32)[:, None]
    masked = np.where(keys > rows, -np.inf, S.astype(np.float64))
    m_new = np.maximum(m0, masked.max(1))
    alpha = np.exp2((m0 - m_new) * scale_log2)
    p = np.exp2((masked - m_new[:, None]) * scale_log2)
    # exp2 in float32 (the GPU's ex2.approx: 2 ulps); sums of 64 terms in float32
    assert np.array_equal(m, m_new.astype(np.float32))
    np.testing.assert_allclose(s, p, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(o, O * alpha[:, None], rtol=1e-5)
    np.testing.assert_allclose(l.sum(1), alpha * l0.sum(1) + p.sum(1), rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_fragment_p_recompute_mask_and_ds_match_numpy(fdev, rng, transposed):
    # dq's orientation (rows queries 64..79, columns keys 70..133: the diagonal crosses the tile) and dk/dv's
    # (rows keys 64..79, columns queries 70..133, T = 120: queries past T masked too)
    r0, c0, T, scale_log2 = 64, 70, 120, np.float32(np.log2(np.e) / 8)
    S, dP = (rng.normal(size=(16, 64)) * 8).astype(np.float32), rng.normal(size=(16, 64)).astype(np.float32)
    n = 64 if transposed else 16
    lse2, d = (rng.normal(size=n) * 8).astype(np.float32), rng.normal(size=n).astype(np.float32)
    s, dp = S.copy(), dP.copy()
    backward_steps[1, 32](s, dp, lse2, d, r0, c0, T, transposed, scale_log2)
    rows, cols = r0 + np.arange(16)[:, None], c0 + np.arange(64)[None, :]
    L, D = (lse2[None, :], d[None, :]) if transposed else (lse2[:, None], d[:, None])
    keep = (rows <= cols) & (cols < T) if transposed else cols <= rows
    p = np.where(keep, np.exp2(S.astype(np.float64) * scale_log2 - L), 0.0)
    assert np.all((s == 0) == ~keep)
    np.testing.assert_allclose(s, p, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(dp, p * (dP - D), rtol=1e-5, atol=1e-6)


# ---- the products at every head size and tile: llmz.fast's device functions, emulated warp-wide in NumPy ------
def _emulated(smem, **constants):
    """llmz.fast.flash_attention.compiled_with(**constants) with its device functions run as plain Python on
    warp-wide values (each lane's register an array of the 32 lanes') and the PTX intrinsics emulated on the
    shared words `smem` (the emulations above): the kernels' own fragment arithmetic, checkable without a GPU."""
    mod = fa.compiled_with(**constants)
    for name, obj in list(vars(mod).items()):
        if hasattr(obj, "py_func"):                 # a cuda.jit function (a simulator or a GPU one)
            setattr(mod, name, obj.py_func)

    def ldmatrix(trans):
        return lambda addr: tuple(_ldmatrix(smem, np.asarray(addr) // 4, trans).T)

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return tuple(_mma(np.stack([a0, a1, a2, a3], 1), np.stack([b0, b1], 1), np.stack([c0, c1, c2, c3], 1)).T)
    mod.ldmatrix_x4, mod.ldmatrix_x4_trans, mod.mma, mod.pack_bf16x2 = ldmatrix(False), ldmatrix(True), mma, _pack
    return mod


@pytest.mark.parametrize("hs, bc, tiles", [(64, 64, 2), (32, 64, 2), (128, 32, 1), (64, 32, 1)])
def test_fragment_products_make_qk_and_pv_at_every_head_size(rng, hs, bc, tiles):
    # S = Q K^T (mma_a_bt, K's rows by ldmatrix) and O = P V (pack_a, then mma_a_b, V down its rows by ldmatrix
    # .trans) for `tiles` row tiles of 16 queries, a streamed tile of bc keys, head size hs: the kernels'
    # offsets and strides for every (HS, BC) they are compiled for, against NumPy's products
    smem = np.zeros(2 * bc * (hs // 2 + 4), np.uint32)
    f = _emulated(smem, HS=hs, BC=bc)
    q, k, v = rand_bf16(rng, (16 * tiles, hs)), rand_bf16(rng, (bc, hs)), rand_bf16(rng, (bc, hs))
    for tile, x in enumerate((k, v)):            # K's tile, then V's, rows of PAD words
        smem.reshape(2, bc, f.PAD)[tile, :, :f.WORDS] = x.view(np.uint32)
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    qw = q.view(np.uint32)
    a = np.zeros((f.A_HS * tiles, 32), np.uint32)   # Q's A fragments, as load_fragments lays them out
    for i in range(tiles):
        for kk in range(hs // 16):
            for n, (r, c) in enumerate(((g, 0), (g + 8, 0), (g, 4), (g + 8, 4))):
                a[f.A_HS * i + 4 * kk + n] = qw[16 * i + r, 8 * kk + c + t]
    s = np.zeros((f.C_BC * tiles, 32))
    f.mma_a_bt(s, a, f.rows_address(0, lanes), tiles)
    p = rng.normal(size=s.shape)                # any P, in S's layout
    pf = np.zeros((f.A_BC * tiles, 32), np.uint32)
    f.pack_a(pf, p, tiles)
    o = np.zeros((f.C_HS * tiles, 32))
    f.mma_a_b(o, pf, f.trans_address(f.TILE_BYTES, lanes), tiles)
    Q, K, V = (bf16_to_f32(x).astype(np.float64) for x in (q, k, v))
    S = Q @ K.T
    P = np.zeros(S.shape)
    for i in range(tiles):                      # the P those registers hold: lane (g, t), rows g, g+8
        for j in range(bc // 8):
            for e in range(4):
                r, c = 16 * i + g + 8 * (e // 2), 8 * j + 2 * t + e % 2
                np.testing.assert_allclose(s[f.C_BC * i + 4 * j + e], S[r, c], rtol=1e-12, atol=1e-12)
                P[r, c] = bf16_to_f32(f32_to_bf16(p[f.C_BC * i + 4 * j + e])).astype(np.float64)
    O = P @ V
    for i in range(tiles):
        for j in range(hs // 8):
            for e in range(4):
                r, c = 16 * i + g + 8 * (e // 2), 8 * j + 2 * t + e % 2
                np.testing.assert_allclose(o[f.C_HS * i + 4 * j + e], O[r, c], rtol=1e-12, atol=1e-12)


def test_fallback_note_speaks_only_for_head_sizes_the_fast_kernels_do_not_cover():
    # one line at start for bf16 --attention flash: none for GPT-2's head size 64 (d12..d48), a note for the
    # sizes the teaching kernels take (small's 32), the refusal's text past what those hold (128)
    assert fa.fast_flash_covers(64) and fa.fallback_note(64) is None
    for hs in (32, 128):
        note = fa.fallback_note(hs)
        assert not fa.fast_flash_covers(hs) and f"head size {hs}" in note and "\n" not in note
    assert fa.fallback_note(32).startswith("note:") and "--attention gemm" in fa.fallback_note(128)


def test_a_run_says_at_start_when_bf16_flash_falls_back_to_the_teaching_kernels():
    # llmz.run.log.flash_fallback: the note for the fast set's bf16 flash at head size 32 (--model small), none at
    # GPT-2's 64, none where the fast kernels are not the ones chosen (teaching set, fp32, gemm attention)
    from llmz.config import preset
    from llmz.run.log import flash_fallback

    class Dev:                                   # what flash_fallback reads of a Device
        def __init__(self, kernel_set="fast", attention="flash", precision="bf16"):
            from llmz.precision import as_precision
            self.kernel_set, self.attention, self.precision = kernel_set, attention, as_precision(precision)
    small, d12 = preset("small"), preset("d12")
    assert flash_fallback(Dev(), small) == fa.fallback_note(32)
    assert flash_fallback(Dev(), d12) is None
    for other in (Dev(kernel_set="teaching"), Dev(attention="gemm"), Dev(precision="fp32")):
        assert flash_fallback(other, small) is None


def test_flash_at_a_head_size_beyond_the_kernels_is_refused_before_any_work():
    from llmz.args import check_flash_head_size
    from llmz.config import GPT2Config, TrainConfig
    from llmz.errors import UsageError
    wide = GPT2Config(num_layers=2, num_heads=2, channels=256, vocab_size=256, padded_vocab_size=256)  # head 128
    cfg = TrainConfig(device="sim", precision="fp32", attention="flash")
    with pytest.raises(UsageError, match=r"^--attention flash: head size 128 .*\(at most 64\); use --attention "
                       r"direct$"):
        check_flash_head_size(cfg, "sim", wide)
    check_flash_head_size(cfg, "sim", preset_with_head(64))     # GPT-2's head size passes
    check_flash_head_size(TrainConfig(device="cpu", attention="flash"), "cpu", wide)  # NumPy takes any


def preset_with_head(hs: int):
    from llmz.config import GPT2Config
    return GPT2Config(num_layers=1, num_heads=2, channels=2 * hs, vocab_size=256, padded_vocab_size=256)
