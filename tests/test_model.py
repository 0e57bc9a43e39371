"""The whole GPT-2: reference backward against finite differences, and the Numba kernels (simulator or
GPU) against the NumPy reference: logits, loss and every gradient tensor."""
import numpy as np
import pytest

from helpers import rel_err
from llmz.config import GPT2Config, preset
from llmz.device import Device
from llmz.layout import Layout, init_parameters
from llmz.model import GPT2, FullGrads, FullParams

TINY = GPT2Config(max_seq_len=8, vocab_size=50, padded_vocab_size=64, num_layers=2, num_heads=2, channels=8)


def random_params(layout, rng):
    """Init, then perturb every tensor (biases and layernorms too) so no gradient path is trivially zero."""
    flat = init_parameters(layout, seed=int(rng.integers(1 << 30)))
    for v in layout.views(flat):
        for t in v.values():
            t += rng.normal(0, 0.1, t.shape)
    v0 = layout.views(flat)[0]
    v0["wte"][layout.config.vocab_size:] = 0          # padded rows stay zero
    return flat


def run(dev, cfg, flat_host, x, y, B, T, buckets=False):
    """Forward and backward once: (loss, logits, gradients, layout) on the host. buckets: the fast wte
    backward (positions sorted by token on the host, as llmz.trainer.Trainer.next_batch does)."""
    layout = Layout(cfg, 1)
    params = dev.asarray(flat_host, dev.dtype)
    grads = dev.zeros(layout.total)
    model = GPT2(cfg, dev, B, T)
    if buckets:
        from llmz.fast.encoder import wte_buckets_upload
        model.wte_buckets = wte_buckets_upload(dev, x)
    pv = FullParams(layout, params)
    xd, yd = dev.asarray(x, np.int32), dev.asarray(y, np.int32)
    model.forward(pv, xd, yd)
    loss = model.mean_loss()
    logits = dev.to_host(model.acts.logits).copy()
    model.backward(pv, FullGrads(layout, grads), xd, yd, 1.0 / (B * T))
    return loss, logits, dev.to_host(grads), layout


def test_model_reference_backward_matches_finite_differences(rng):
    B, T = 2, 5
    dev = Device("cpu", np.float64)
    layout = Layout(TINY, 1)
    flat = random_params(layout, rng)
    x = rng.integers(0, TINY.vocab_size, (B, T))
    y = rng.integers(0, TINY.vocab_size, (B, T))
    _, _, grads, _ = run(dev, TINY, flat, x, y, B, T)

    model = GPT2(TINY, dev, B, T)

    def loss_at(f):
        model.forward(FullParams(layout, f), x.astype(np.int32), y.astype(np.int32))
        return model.mean_loss()
    # a few elements of every tensor of every bucket, central differences in float64
    eps = 1e-5
    checked = 0
    gv = layout.views(grads)
    for b, views in enumerate(layout.views(flat)):
        for name, t in views.items():
            flat_t = t.reshape(-1)
            n = TINY.vocab_size * TINY.channels if name == "wte" else flat_t.size   # real wte rows only
            for i in rng.choice(n, min(3, n), replace=False):
                old = flat_t[i]
                flat_t[i] = old + eps
                lp = loss_at(flat)
                flat_t[i] = old - eps
                lm = loss_at(flat)
                flat_t[i] = old
                fd = (lp - lm) / (2 * eps)
                an = gv[b][name].reshape(-1)[i]
                assert abs(an - fd) <= 1e-6 * max(abs(fd), 1e-3), (layout.buckets[b].name, name, i, an, fd)
                checked += 1
    assert checked > 50
    # padded wte rows get no gradient
    assert np.all(gv[0]["wte"][TINY.vocab_size:] == 0)


@pytest.mark.parametrize("kernel_set", ["teaching", "fast"])
def test_model_kernels_match_reference_logits_loss_and_every_gradient(kdev, fdev, rng, kernel_set):
    # the fast set in the simulator: every fast kernel but cuBLAS (the tiled product, direct attention), the
    # wte backward on its token buckets
    dev = kdev if kernel_set == "teaching" else fdev
    B, T = 2, 8
    layout = Layout(TINY, 1)
    flat = random_params(layout, rng)
    x = rng.integers(0, TINY.vocab_size, (B, T))
    y = rng.integers(0, TINY.vocab_size, (B, T))
    loss_k, logits_k, grads_k, _ = run(dev, TINY, flat.astype(np.float32), x, y, B, T, buckets=dev.fast)
    loss_r, logits_r, grads_r, _ = run(Device("cpu", np.float64), TINY, flat, x, y, B, T)
    # float32 kernels against the float64 reference: rounding of sums over at most 4C = 32 terms
    assert abs(loss_k - loss_r) / abs(loss_r) < 1e-5
    assert rel_err(logits_k[..., :TINY.vocab_size], logits_r[..., :TINY.vocab_size]) < 1e-5
    gk, gr = layout.views(grads_k), layout.views(grads_r)
    for b in range(len(layout.buckets)):
        for name in gr[b]:
            assert rel_err(gk[b][name], gr[b][name]) < 1e-4, (layout.buckets[b].name, name)


D12_B, D12_T = 4, 1024


@pytest.fixture(scope="module")
def d12_reference():
    """d12 at B=4, T=1024: parameters, batch, and the float64 NumPy reference's loss and gradients (slow on
    the CPU side: minutes, so computed once for every path below)."""
    rng = np.random.default_rng(0)
    cfg = preset("d12")
    layout = Layout(cfg, 1)
    flat = init_parameters(layout, 0)
    x = rng.integers(0, cfg.vocab_size, (D12_B, D12_T))
    y = rng.integers(0, cfg.vocab_size, (D12_B, D12_T))
    loss_r, _, grads_r, _ = run(Device("cpu", np.float64), cfg, flat, x, y, D12_B, D12_T)
    return cfg, layout, flat, x, y, loss_r, grads_r


# (kernel set, TF32, wte buckets) and the bounds: (loss, worst gradient tensor), relative
D12_PATHS = {"teaching": (("teaching", False, False), (1e-5, 1e-3)),
             "fast-fp32": (("fast", False, True), (1e-5, 1e-3)),
             "fast-tf32": (("fast", True, True), (1e-3, 5e-2))}


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(D12_PATHS))
def test_d12_loss_and_gradients_on_gpu_match_float64_reference(d12_reference, path):
    cfg, layout, flat, x, y, loss_r, grads_r = d12_reference
    (kernel_set, tf32, buckets), (loss_tol, grad_tol) = D12_PATHS[path]
    dev = Device("gpu", np.float32, kernel_set=kernel_set, tf32=tf32)
    loss_g, _, grads_g, _ = run(dev, cfg, flat.astype(np.float32), x, y, D12_B, D12_T, buckets)
    print(f"d12 {path}: loss gpu {loss_g:.6f} ref {loss_r:.6f} rel {abs(loss_g - loss_r) / loss_r:.2e}")
    worst = {}
    gg, gr = layout.views(grads_g), layout.views(grads_r)
    for b in range(len(layout.buckets)):
        for name in gr[b]:
            worst[name] = max(worst.get(name, 0.0), rel_err(gg[b][name], gr[b][name]))
    print(f"d12 {path}: worst relative gradient error per tensor " +
          ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert abs(loss_g - loss_r) / loss_r < loss_tol
    assert max(worst.values()) < grad_tol
