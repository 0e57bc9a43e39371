"""The reference op set (llmz/reference.py, what a cpu Device runs): where a layer is written out again for
speed (llmz.host_loops' loops, NumPy's products into kept buffers), it gives its `_ref`'s bits, every byte,
on fresh random inputs in float32 and float64, at sizes that take every path of NumPy's pairwise summation
(rows under 8, up to 128, above 128 and not a multiple of 8), twice in a row (the kept buffers reused) and
after a larger call (a buffer grown, then viewed smaller). The `_ref`s are the layers' definition: the
kernels are tested against them, and they against finite differences in float64."""
import numpy as np
import pytest

from llmz import host_loops, reference
from llmz.device import Device
from llmz.kernels.adamw import adamw_update_ref
from llmz.kernels.attention import attention_backward_ref, attention_forward_ref
from llmz.kernels.classifier import classifier_fused_ref
from llmz.kernels.encoder import encoder_backward_ref
from llmz.kernels.gelu import gelu_backward_ref, gelu_forward_ref
from llmz.kernels.layernorm import layernorm_backward_ref, layernorm_forward_ref
from llmz.kernels.matmul import matmul_backward_ref, matmul_forward_ref
from llmz.kernels.residual import residual_forward_ref

DTYPES = [np.float32, np.float64]
# (B, T, C, NH): the default run's sizes; odd ones (rows of 5, 7 and 13); C above 128 (the pairwise split)
SIZES = [(4, 64, 128, 4), (3, 7, 24, 3), (2, 13, 200, 4), (1, 5, 12, 2)]


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check(op, ref, arrays, calls=2):
    """op(dev, *copies) and ref(*other copies), `calls` times each: every array (outputs and inputs) the same
    bytes after each call."""
    ours, theirs = ([None if a is None else a.copy() for a in arrays] for _ in range(2))
    for call in range(calls):
        op(*ours)
        ref(*theirs)
        for i, (x, y) in enumerate(zip(ours, theirs)):
            assert x is y is None or same_bits(x, y), \
                f"call {call}: array {i} differs in {np.sum(x != y)} of {x.size} elements"


@pytest.fixture(params=DTYPES, ids=["float32", "float64"])
def dt(request):
    return request.param


@pytest.fixture
def dev(dt):
    return Device("cpu", dt)


@pytest.mark.parametrize("B, T, C, NH", SIZES)
def test_layernorm_gives_the_references_bits(rng, dt, dev, B, T, C, NH):
    r = lambda *shape: rng.normal(size=shape).astype(dt)
    inp = (r(B, T, C) * rng.uniform(0.5, 3, (B, T, 1)) + r(B, T, 1)).astype(dt)
    check(lambda *a: reference.layernorm_forward(dev, *a), layernorm_forward_ref,
          [r(B, T, C), r(B, T), r(B, T), inp, r(C), r(C)])
    mean = inp.mean(axis=-1)
    rstd = (1 / np.sqrt(inp.var(axis=-1) + 1e-5)).astype(dt)
    check(lambda *a: reference.layernorm_backward(dev, *a), layernorm_backward_ref,
          [r(B, T, C), r(C), r(C), r(B, T, C), inp, r(C), mean, rstd])


@pytest.mark.parametrize("B, T, C, NH", SIZES)
def test_gelu_and_residual_give_the_references_bits(rng, dt, dev, B, T, C, NH):
    r = lambda *shape: rng.normal(size=shape).astype(dt)
    x = 3 * r(B, T, 4 * C)
    check(lambda *a: reference.gelu_forward(dev, *a), gelu_forward_ref, [r(B, T, 4 * C), x])
    for accumulate in (True, False):
        check(lambda *a: reference.gelu_backward(dev, *a, accumulate), lambda *a: gelu_backward_ref(*a, accumulate),
              [r(B, T, 4 * C), x, r(B, T, 4 * C)])
    check(lambda *a: reference.residual_forward(dev, *a), residual_forward_ref, [r(B, T, C), r(B, T, C), r(B, T, C)])


@pytest.mark.parametrize("B, T, C, NH", SIZES)
def test_matmul_gives_the_references_bits(rng, dt, dev, B, T, C, NH):
    r = lambda *shape: rng.normal(size=shape).astype(dt)
    for OC, IC in [(3 * C, C), (C, 4 * C), (256, C)]:
        check(lambda *a: reference.matmul_forward(dev, *a), matmul_forward_ref,
              [r(B, T, OC), r(B, T, IC), r(OC, IC), r(OC)])
        for accumulate in (True, False):
            for bias in (r(OC), None):
                check(lambda *a: reference.matmul_backward(dev, *a, dinp_accumulate=accumulate),
                      lambda *a: matmul_backward_ref(*a, dinp_accumulate=accumulate),
                      [r(B, T, IC), r(OC, IC), bias, r(B, T, OC), r(B, T, IC), r(OC, IC)])


@pytest.mark.parametrize("B, T, C, NH", SIZES)
def test_attention_gives_the_references_bits(rng, dt, dev, B, T, C, NH):
    r = lambda *shape: rng.normal(size=shape).astype(dt)
    qkv = 2 * r(B, T, 3 * C)
    check(lambda o, p, a, i: reference.attention_forward(dev, o, p, a, i, NH),
          lambda o, p, a, i: attention_forward_ref(o, p, a, i, NH), [r(B, T, C), r(B, NH, T, T), r(B, NH, T, T), qkv])
    att = np.zeros((B, NH, T, T), dt)
    attention_forward_ref(np.zeros((B, T, C), dt), np.zeros_like(att), att, qkv, NH)
    for accumulate in (True, False):
        check(lambda *a: reference.attention_backward(dev, *a, NH, accumulate),
              lambda *a: attention_backward_ref(*a, NH, accumulate),
              [r(B, T, 3 * C), r(B, NH, T, T), r(B, NH, T, T), r(B, T, C), qkv, att])


@pytest.mark.parametrize("B, T, C, NH", SIZES)
def test_classifier_embeddings_and_adamw_give_the_references_bits(rng, dt, dev, B, T, C, NH):
    r = lambda *shape: rng.normal(size=shape).astype(dt)
    V, Vp = 100, 128
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    check(lambda lo, x: reference.classifier_fused(dev, lo, x, targets, 0.01, V),
          lambda lo, x: classifier_fused_ref(lo, x, targets, 0.01, V), [r(B, T), 3 * r(B, T, Vp)])
    tokens = rng.integers(0, 4, (B, T)).astype(np.int32)        # few tokens: rows added to many times
    check(lambda e, p, d: reference.encoder_backward(dev, e, p, d, tokens),
          lambda e, p, d: encoder_backward_ref(e, p, d, tokens), [r(Vp, C), r(T + 3, C), r(B, T, C)])
    n = B * T * C
    scalars = np.array([3e-3, 0.7, 1 - 0.9**3, 1 - 0.95**3, 3.0])
    for weight_decay in (0.1, 0.0):
        args = (n // 2, scalars, 0.9, 0.95, 1e-8, weight_decay)
        check(lambda *a: reference.adamw_update(dev, *a, *args), lambda *a: adamw_update_ref(*a, *args),
              [r(n), r(n), 0.1 * r(n), 0.01 * np.abs(r(n))])


def test_a_kept_buffer_grows_for_a_larger_call_and_serves_a_smaller_one(rng):
    dev = Device("cpu", np.float32)
    big, small = reference.buffer(dev, "t", (4, 8), np.float32), reference.buffer(dev, "t", (3,), np.float32)
    assert np.shares_memory(big, small) and small.shape == (3,)
    bigger = reference.buffer(dev, "t", (10, 10), np.float32)
    assert bigger.shape == (10, 10) and not np.shares_memory(big, bigger)
    assert not np.shares_memory(bigger, reference.buffer(Device("cpu", np.float32), "t", (10, 10), np.float32))


@pytest.mark.parametrize("n", [*range(1, 40), 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4099])
def test_pairwise_is_numpys_sum_of_a_row(rng, dt, n):
    """host_loops.pairwise against NumPy's own sum along a row: values of mixed sign and size, where every
    order of summation rounds differently (a mutation of the order fails here)."""
    rows = (rng.normal(size=(20, n)) * 10.0 ** rng.uniform(-3, 3, size=(20, n))).astype(dt)
    ours = np.array([host_loops.pairwise(row, n) for row in rows], dtype=dt)
    assert same_bits(ours, rows.sum(axis=-1))
