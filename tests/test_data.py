"""The data loader reads exactly llm.c's batches: rank r's micro-batch i starts at (i mod n)*P*B*T + r*B*T,
so P ranks together read what one rank reads with batch P*B; it wraps after n batches, shuffles the same
way on every rank, and resumes exactly from its state; a file's fingerprint (the ranks compare them at start)
is the same for every copy of it."""
import os

import numpy as np
import pytest

from llmz.data import DataLoader, write_tokens
from llmz.errors import LlmzError

P, B, T = 2, 2, 4
NTOK = 203                     # n = (203 - 1) // (2*2*4) = 12 batch positions, 10 tokens left over


@pytest.fixture
def stream(tmp_path):
    """A token file holding 0, 1, 2, ..., so every token says where it came from."""
    path = tmp_path / "stream.bin"
    write_tokens(str(path), np.arange(NTOK))
    return str(path)


def loaders(path, world_size=P, b=B, **kw):
    return [DataLoader(path, b, T, rank=r, world_size=world_size, **kw) for r in range(world_size)]


def test_rank_r_micro_batch_i_starts_at_llmc_offset_and_wraps_after_n(stream):
    ranks = loaders(stream)
    n = (NTOK - 1) // (P * B * T)
    assert n == 12 and all(ld.num_batches == n for ld in ranks)
    for i in range(3 * n + 5):                       # three epochs and a bit: wrap-around included
        for r, ld in enumerate(ranks):
            x, y = ld.next_batch()
            start = (i % n) * P * B * T + r * B * T
            assert x.dtype == np.int32 and y.dtype == np.int32 and x.shape == (B, T) == y.shape
            assert np.array_equal(x.ravel(), np.arange(start, start + B * T)), (i, r)
            assert np.array_equal(y, x + 1)           # targets are the next tokens
        assert ranks[0].epoch == (i + 1) // n


def test_ranks_together_read_the_same_tokens_as_one_rank_with_batch_P_times_B(stream):
    ranks = loaders(stream)
    (single,) = loaders(stream, world_size=1, b=P * B)
    assert single.num_batches == ranks[0].num_batches
    for _ in range(2 * single.num_batches):
        xs, ys = zip(*(ld.next_batch() for ld in ranks))
        x, y = single.next_batch()
        assert np.array_equal(np.concatenate(xs), x) and np.array_equal(np.concatenate(ys), y)


def test_data_exactly_one_batch_plus_one_token_gives_one_position(tmp_path):
    path = tmp_path / "exact.bin"
    write_tokens(str(path), np.arange(P * B * T + 1))
    ranks = loaders(str(path))
    assert ranks[0].num_batches == 1
    x1, x2 = ranks[1].next_batch()[0], ranks[1].next_batch()[0]
    assert np.array_equal(x1, x2) and x1[0, 0] == B * T


def test_batch_larger_than_the_data_fails_with_one_line_naming_file_and_sizes(tmp_path):
    path = tmp_path / "small.bin"
    write_tokens(str(path), np.arange(P * B * T))          # one token short
    with pytest.raises(LlmzError) as e:
        DataLoader(str(path), B, T, rank=0, world_size=P)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and "16 tokens" in msg and "17 tokens" in msg


def test_glob_matching_nothing_fails_naming_the_glob(tmp_path):
    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(LlmzError) as e:
        DataLoader(pattern, B, T)
    assert str(e.value) == f"{pattern}: no file matches"


def test_tokens_outside_the_vocabulary_fail_naming_the_file(stream):
    with pytest.raises(LlmzError) as e:
        DataLoader(stream, B, T, vocab_size=100)
    assert str(e.value).startswith(stream) and "token 100 at position 100" in str(e.value)


def test_glob_files_are_concatenated_in_sorted_order(tmp_path):
    # written in reverse order, so only sorting puts them back
    for k in (2, 1, 0):
        write_tokens(str(tmp_path / f"shard_{k:03d}.bin"), np.arange(k * 50, (k + 1) * 50))
    ld = DataLoader(str(tmp_path / "shard_*.bin"), B, T, rank=1, world_size=P)
    assert [p[-13:] for p in ld.files] == ["shard_000.bin", "shard_001.bin", "shard_002.bin"]
    assert np.array_equal(ld.tokens, np.arange(150)) and ld.num_batches == 149 // 16
    for i in range(ld.num_batches):                  # batches span file boundaries (batch 3 covers 56..64)
        start = i * 16 + 8
        assert np.array_equal(ld.next_batch()[0].ravel(), np.arange(start, start + 8))
    same = DataLoader([str(tmp_path / f"shard_{k:03d}.bin") for k in range(3)], B, T)
    assert np.array_equal(same.tokens, ld.tokens)


def test_shuffle_visits_every_position_once_per_epoch_in_the_same_order_on_every_rank(stream):
    ranks = loaders(stream, shuffle=True, seed=7)
    n = ranks[0].num_batches
    orders = []
    for epoch in range(3):
        order = []
        for _ in range(n):
            starts = [ld.next_batch()[0][0, 0] - r * B * T for r, ld in enumerate(ranks)]
            assert starts[0] == starts[1]             # the same batch position on every rank
            order.append(int(starts[0]) // (P * B * T))
        assert sorted(order) == list(range(n))       # a permutation of the n positions
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]       # a new permutation each epoch
    again = [loaders(stream, shuffle=True, seed=7)[0].next_batch()[0][0, 0] for _ in range(2)]
    assert again[0] == again[1] == orders[0][0] * P * B * T    # seeded: the same on a fresh start
    other = DataLoader(stream, B, T, world_size=P, shuffle=True, seed=8)
    assert [int(other.next_batch()[0][0, 0]) // (P * B * T) for _ in range(n)] != orders[0]


@pytest.mark.parametrize("shuffle", [False, True])
def test_load_state_continues_exactly_where_the_loader_was(stream, shuffle):
    a = DataLoader(stream, B, T, rank=1, world_size=P, shuffle=shuffle, seed=3)
    for _ in range(17):                               # past the end of the first epoch (n = 12)
        a.next_batch()
    state = a.state()
    assert state["position"] == 17 and state["epoch"] == 1
    expect = [a.next_batch() for _ in range(20)]
    b = DataLoader(stream, B, T, rank=1, world_size=P, shuffle=shuffle, seed=3)
    b.load_state(state)
    for (x0, y0), (x1, y1) in zip(expect, (b.next_batch() for _ in range(20))):
        assert np.array_equal(x0, x1) and np.array_equal(y0, y1)
    b.reset()
    fresh = DataLoader(stream, B, T, rank=1, world_size=P, shuffle=shuffle, seed=3)
    assert b.position == 0 and np.array_equal(b.next_batch()[0], fresh.next_batch()[0])


def test_load_state_refuses_a_different_batch_shape(stream):
    state = DataLoader(stream, B, T, world_size=P).state()
    other = DataLoader(stream, B, T, world_size=1)
    with pytest.raises(LlmzError) as e:
        other.load_state(state)
    assert "world_size=2 (here 1)" in str(e.value) and "\n" not in str(e.value)


def test_bad_batch_arguments_fail_with_one_line(stream):
    for kw in ({"B": 0, "T": 4}, {"B": 2, "T": -1}, {"B": 2, "T": 4, "rank": 2, "world_size": 2}):
        with pytest.raises(LlmzError):
            DataLoader(stream, **kw)


def test_a_files_digest_is_sha256_of_all_its_bytes_the_same_for_copies_and_changed_by_one_token_anywhere(
        tmp_path, rng, monkeypatch):
    import hashlib

    import llmz.files
    from llmz.data import file_digest
    monkeypatch.setattr(llmz.files, "HASH_CHUNK", 4096)     # read and hashed in pieces (64 MiB in a run)
    tokens = rng.integers(0, 256, 50_000)
    write_tokens(str(tmp_path / "a.bin"), tokens)
    os.makedirs(tmp_path / "elsewhere")
    write_tokens(str(tmp_path / "elsewhere" / "a.bin"), tokens)           # a copy under another name
    raw = (tmp_path / "a.bin").read_bytes()
    loader = DataLoader(str(tmp_path / "a.bin"), 2, 8)
    assert loader.digests == [(str(tmp_path / "a.bin"), len(raw), hashlib.sha256(raw).hexdigest())]   # sha256sum's
    assert file_digest(str(tmp_path / "a.bin")) == loader.digests[0][1:]
    assert DataLoader(str(tmp_path / "elsewhere" / "a.bin"), 2, 8).digests[0][1:] == loader.digests[0][1:]
    np.testing.assert_array_equal(loader.tokens, tokens)                # hashing while reading reads the same
    for i in (0, int(rng.integers(1, tokens.size - 1)), tokens.size - 1):   # one token anywhere, the ends too
        changed = tokens.copy()
        changed[i] ^= 1
        write_tokens(str(tmp_path / "b.bin"), changed)
        assert DataLoader(str(tmp_path / "b.bin"), 2, 8).digests[0][2] != loader.digests[0][2], i
