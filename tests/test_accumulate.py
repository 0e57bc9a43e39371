"""ZeRO-2's fused accumulate: this rank's part of the slot added into its shard, the whole slot zeroed, and
nothing else touched."""
import numpy as np
import pytest

from llmz.kernels.accumulate import accumulate_shard, accumulate_shard_ref

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
