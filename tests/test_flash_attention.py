"""Flash attention: the NumPy reference against the plain attention reference and finite differences, the
teaching kernels (simulator or GPU) against the reference, and on a GPU the tensor-core kernels
(llmz.fast.flash_attention, llmz.fast.mma) against float64 and against the teaching kernels."""
import numpy as np
import pytest
from test_bf16_storage import NAN_BF16, assert_within_one_step, rand_bf16

from helpers import finite_diff, poisoned, rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.kernels.attention import attention_backward_ref, attention_forward_ref
from llmz.kernels.flash_attention import (
    BLOCK,
    flash_attention_backward,
    flash_attention_backward_ref,
    flash_attention_forward,
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
    """Teaching flash forward + backward on `dev` with values stored as `dtype`, on poisoned outputs:
    out, lse, dinp on the host."""
    B, T, C3 = inp.shape
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    def poison(shape, dt):
        return dev.full(shape, NAN_BF16, dt) if dt == np.uint16 else poisoned(dev, shape, dt)
    out, lse = poison((B, T, C3 // 3), dtype), poison((B, NH, T), lse_dtype)
    x = dev.asarray(inp, dtype)
    flash_attention_forward(dev, out, lse, x, NH)
    dinp = poison(inp.shape, dtype) if dinp0 is None else dev.asarray(dinp0, dtype)
    flash_attention_backward(dev, dinp, dev.asarray(dout, dtype), x, out, lse, NH, accumulate)
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
    return Device("gpu", np.uint16, matmul="cublas", attention="flash")


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
    teach = Device("gpu", np.uint16, matmul="numba", attention="flash")
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
