"""AdamW's fast kernel for bf16 training (llmz/fast/adamw.py: a unit of 8 elements a thread, the update in
float32) against the float64 reference (llmz/kernels/adamw.py's adamw_update_bf16_ref) and the teaching kernel:
master, m and v within a few float32 ulps of float64; params the bf16 rounding of this master with each
element's own random word (bit for bit, checked against the host rounding); the fast layer takes the units
only for arrays of whole units on 16 bytes, the teaching kernel (the reference's bits) otherwise."""
import numpy as np
import pytest
from test_adamw import BETA1, BETA2, EPS, SEED, WD, random_bf16_state, scalars5_at

from helpers import rel_err
from llmz.bf16 import bf16_to_f32, f32_to_bf16, f32_to_bf16_stochastic
from llmz.fast import adamw as fast
from llmz.kernels.adamw import adamw_update_bf16_ref


def fast_step(dev, state, g, decay, t, stochastic, offset):
    """One fast AdamW step on device copies of state = (params, master, m, v), params poisoned with the bf16 NaN
    (only written). Returns [params, master, m, v] on the host."""
    params = dev.full(g.size, 0x7FC0, np.uint16)
    master, m, v = (dev.asarray(a) for a in state[1:])
    fast.adamw_update_bf16(dev, params, master, dev.asarray(g), m, v, decay, dev.asarray(scalars5_at(t)), BETA1,
                           BETA2, EPS, WD, SEED, stochastic, offset)
    return [dev.to_host(a) for a in (params, master, m, v)]


def check_step(got, state, g, decay, t, stochastic, offset):
    """master, m, v against the float64 update; params the rounding of the kernel's own master."""
    params, master, m, v = (a.copy() for a in state)
    adamw_update_bf16_ref(params, master, g, m, v, decay, scalars5_at(t), BETA1, BETA2, EPS, WD, SEED, stochastic,
                          offset)
    # float32 arithmetic (products, one division, one square root) against float64 rounded once: each element
    # within a few float32 ulps of the terms it is made of (m = beta1 m + (1 - beta1) g may cancel: its error
    # is the terms' rounding, not the result's)
    g32 = bf16_to_f32(g).astype(np.float64) * scalars5_at(t)[1]
    terms = {"master": np.abs(state[1]) + np.abs(state[1] - master),       # the master and its update
             "m": BETA1 * np.abs(state[2]) + (1 - BETA1) * np.abs(g32),
             "v": np.abs(v)}
    for name, a, b in zip(("master", "m", "v"), got[1:], (master, m, v)):
        assert rel_err(a, b) < 1e-6, name
        assert np.all(np.abs(a.astype(np.float64) - b) <= 4 * 2.0 ** -24 * terms[name]), name
    # the bf16 parameters: exactly the host's rounding of the kernel's master (the same random word per element)
    want = f32_to_bf16_stochastic(got[1], SEED, t, offset) if stochastic else f32_to_bf16(got[1])
    np.testing.assert_array_equal(got[0], want)
    assert not np.any(got[0] == 0x7FC0), "NaN left in params"


@pytest.mark.parametrize("stochastic", [True, False])
# elements in the simulator (32-thread blocks, a unit of 8 a thread: 256 a block): 296 less than two blocks,
# 2056 a unit past eight
@pytest.mark.parametrize("n", [296, 2056])
def test_adamw_bf16_units_kernel_matches_the_float64_update(fdev, rng, launched, stochastic, n):
    # decay_size odd: the unit of elements decay-1 and decay straddles it (one decayed, one not); a nonzero
    # hash offset, as a ZeRO shard passes
    decay, offset = 8 * (n // 24) + 3, 1001
    state = random_bf16_state(rng, n)
    g = f32_to_bf16(rng.normal(size=n))
    names = launched(fdev)
    got = fast_step(fdev, state, g, decay, 3, stochastic, offset)
    assert names == ["adamw_bf16_units_kernel"]
    check_step(got, state, g, decay, 3, stochastic, offset)


def test_adamw_bf16_fast_layer_takes_the_units_for_aligned_whole_units_only(fdev, rng, launched):
    # the arrays are views into buffers, as ZeRO's shards are, drawing at hash index 1000 + their start
    names = launched(fdev)
    size, decay = 97, 33
    state = random_bf16_state(rng, size)
    g = f32_to_bf16(rng.normal(size=size))
    for start, n, want in ((0, 80, "adamw_bf16_units_kernel"),      # whole units, on 16 bytes
                           (8, 88, "adamw_bf16_units_kernel"),      # a view at unit 1
                           (0, 79, "adamw_bf16_kernel"),            # not a whole number of units
                           (2, 80, "adamw_bf16_kernel")):           # a view off 16 bytes
        bufs = [fdev.asarray(a) for a in state]
        p, master, m, v = (b[start:start + n] for b in bufs)
        fast.adamw_update_bf16(fdev, p, master, fdev.asarray(g)[start:start + n], m, v, decay,
                               fdev.asarray(scalars5_at(2)), BETA1, BETA2, EPS, WD, SEED, offset=1000 + start)
        assert names[-1] == want, (start, n)
        got = [fdev.to_host(a) for a in (p, master, m, v)]
        check_step(got, [a[start:start + n] for a in state], g[start:start + n], decay, 2, True, 1000 + start)


@pytest.mark.gpu
@pytest.mark.parametrize("stochastic", [True, False])
def test_adamw_bf16_units_kernel_matches_the_float64_update_at_gpt2_size(kdev, fdev, rng, stochastic):
    # GPT-2 124M's parameter count (whole units); decay_size odd (a unit straddles it); a ZeRO-like hash offset
    n, decay, offset = 124_475_904, 85_000_001, 12_345
    state = random_bf16_state(rng, n)
    g = f32_to_bf16(rng.normal(size=n) * 1e-2)
    got = fast_step(fdev, state, g, decay, 5, stochastic, offset)
    check_step(got, state, g, decay, 5, stochastic, offset)
    params_t = kdev.full(n, 0x7FC0, np.uint16)
    master_t, m_t, v_t = (kdev.asarray(a) for a in state[1:])
    from llmz.kernels.adamw import adamw_update_bf16
    adamw_update_bf16(kdev, params_t, master_t, kdev.asarray(g), m_t, v_t, decay, kdev.asarray(scalars5_at(5)),
                      BETA1, BETA2, EPS, WD, SEED, stochastic, offset)
    pt = kdev.to_host(params_t)
    print(f"adamw bf16 n={n} stochastic={stochastic}: params of the units kernel vs the teaching kernel "
          f"{np.mean(pt == got[0]):.6%} bit-identical, master {np.mean(kdev.to_host(master_t) == got[1]):.6%}")
    # where the masters differ by an ulp the rounding may differ by a step
    assert np.max(np.abs(bf16_to_f32(pt) - bf16_to_f32(got[0])) / np.maximum(np.abs(bf16_to_f32(pt)), 1e-30)) \
        <= 2 ** -7
