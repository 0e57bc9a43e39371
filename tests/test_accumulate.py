"""ZeRO-2's fused accumulate (llmz/kernels/accumulate.py; no fast version): this rank's part of the slot added
into its shard, the whole slot zeroed, and nothing else touched; in bf16, the sum rounded stochastically."""
import numpy as np
import pytest

from llmz.bf16 import f32_to_bf16
from llmz.kernels.accumulate import (
    accumulate_shard,
    accumulate_shard_bf16,
    accumulate_shard_bf16_ref,
    accumulate_shard_ref,
)

SEED = 1234

CASES = [(2, 0), (2, 1), (4, 0), (4, 2), (4, 3)]               # (world size N, rank)


def run(kdev, rng, N, rank, n, dtype, use_kernel=True):
    """shard and slot as views inside larger buffers, so writes outside them would show."""
    shard_buf = rng.normal(size=n + 10).astype(dtype)             # the shard is [5, 5 + n)
    slot_buf = rng.normal(size=2 * N * n).astype(dtype)           # two slots; the kernel gets the second
    if use_kernel:
        s, t = kdev.asarray(shard_buf), kdev.asarray(slot_buf)
        accumulate_shard(kdev, s[5:5 + n], t[N * n:], rank)
        return shard_buf, slot_buf, kdev.to_host(s), kdev.to_host(t)
    s, t = shard_buf.copy(), slot_buf.copy()
    accumulate_shard_ref(s[5:5 + n], t[N * n:], rank)
    return shard_buf, slot_buf, s, t


def check(N, rank, n, shard0, slot0, shard, slot):
    mine = slot0[N * n + rank * n:N * n + (rank + 1) * n]
    assert np.array_equal(shard[5:5 + n], shard0[5:5 + n] + mine)   # an exact add, same rounding as NumPy
    assert np.array_equal(shard[:5], shard0[:5]) and np.array_equal(shard[5 + n:], shard0[5 + n:])
    assert np.all(slot[N * n:] == 0)                                 # the whole slot zeroed
    assert np.array_equal(slot[:N * n], slot0[:N * n])               # the other slot untouched


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N, rank", CASES)
def test_accumulate_shard_kernel_adds_my_part_and_zeroes_slot(kdev, rng, N, rank, dtype):
    n = 37                                                         # N*n not a multiple of the block size
    check(N, rank, n, *run(kdev, rng, N, rank, n, dtype))


@pytest.mark.parametrize("N, rank", CASES)
def test_accumulate_shard_reference_adds_my_part_and_zeroes_slot(kdev, rng, N, rank):
    n = 37
    check(N, rank, n, *run(kdev, rng, N, rank, n, np.float32, use_kernel=False))


def test_accumulate_shard_runs_on_the_comm_stream(kdev, rng):
    N, rank, n = 2, 1, 37
    shard0, slot0 = rng.normal(size=n).astype(np.float32), rng.normal(size=N * n).astype(np.float32)
    shard, slot = kdev.asarray(shard0), kdev.asarray(slot0)
    accumulate_shard(kdev, shard, slot, rank, stream=kdev.comm_stream)
    kdev.comm_stream.synchronize()
    assert np.array_equal(kdev.to_host(shard), shard0 + slot0[n:])
    assert np.all(kdev.to_host(slot) == 0)


def test_accumulate_shard_rejects_a_slot_that_does_not_split(kdev):
    shard = kdev.asarray(np.ones(10, np.float32))
    with pytest.raises(ValueError):
        accumulate_shard(kdev, shard, kdev.asarray(np.ones(25, np.float32)), 0)
    with pytest.raises(ValueError):
        accumulate_shard(kdev, shard, kdev.asarray(np.ones(20, np.float32)), 2)


@pytest.mark.gpu
def test_accumulate_shard_kernel_at_gpt2_block_size(kdev, rng):
    N, rank = 4, 1
    n = 7_087_872 // N                                             # one GPT-2 124M block bucket, 4 ranks
    check(N, rank, n, *run(kdev, rng, N, rank, n, np.float32))


# ---- the bf16 ZeRO-2 accumulate kernel ---------------------------------------------------------------


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("N, rank", [(2, 0), (2, 1), (4, 0), (4, 3)])
def test_accumulate_shard_bf16_kernel_matches_reference_and_zeroes_slot(kdev, rng, N, rank, stochastic):
    n = 37                                                                 # N*n not a multiple of the block
    # shard and slot are views inside larger buffers, so a write outside them would show
    shard0 = f32_to_bf16(rng.normal(size=n + 10))                          # the shard is [5, 5 + n)
    shard_k, shard_r = kdev.asarray(shard0), shard0.copy()
    for step in range(3):                                                  # three micro-steps
        slot0 = f32_to_bf16(rng.normal(size=2 * N * n) * 0.05)             # two slots; the second one is used
        slot_k, slot_r = kdev.asarray(slot0), slot0.copy()
        accumulate_shard_bf16(kdev, shard_k[5:5 + n], slot_k[N * n:], rank, SEED, step, stochastic, offset=300)
        accumulate_shard_bf16_ref(shard_r[5:5 + n], slot_r[N * n:], rank, SEED, step, stochastic, offset=300)
        slot = kdev.to_host(slot_k)
        assert np.all(slot[N * n:] == 0)                                   # the whole slot zeroed
        assert np.array_equal(slot[:N * n], slot0[:N * n])                 # the other slot untouched
    shard = kdev.to_host(shard_k)
    assert np.array_equal(shard, shard_r)                                  # an fp32 add and integer rounding
    assert np.array_equal(shard[:5], shard0[:5]) and np.array_equal(shard[5 + n:], shard0[5 + n:])
    # and it did accumulate: the shard moved
    assert np.mean(shard[5:5 + n] != shard0[5:5 + n]) > 0.5


def test_accumulate_shard_bf16_rejects_a_slot_that_does_not_split(kdev):
    shard = kdev.asarray(np.ones(10, np.uint16))
    with pytest.raises(ValueError):
        accumulate_shard_bf16(kdev, shard, kdev.asarray(np.ones(25, np.uint16)), 0, SEED, 0)


@pytest.mark.gpu
def test_accumulate_shard_bf16_kernel_matches_reference_at_gpt2_block_size(kdev, rng):
    N, rank = 4, 1
    n = 7_087_872 // N                                             # one GPT-2 124M block bucket
    shard0, slot0 = f32_to_bf16(rng.normal(size=n) * 1e-2), f32_to_bf16(rng.normal(size=N * n) * 1e-3)
    shard, slot = kdev.asarray(shard0), kdev.asarray(slot0)
    accumulate_shard_bf16(kdev, shard, slot, rank, SEED, 7, offset=12345)
    accumulate_shard_bf16_ref(shard0, slot0, rank, SEED, 7, offset=12345)
    assert np.array_equal(kdev.to_host(shard), shard0)
    assert not np.any(kdev.to_host(slot))


