"""llm.c token files and the data loader that cuts them into (B, T) batches, exactly as llm.c does.

Token file: a header of 256 int32 ([0]=20240520 magic, [1]=1 version, [2]=number of tokens), then the
tokens as uint16; its size is exactly 1024 + 2 * ntok bytes.

Ranks agree on their data before any work (`check_same_data`): each rank reads its own files (a relative
glob, node-local copies), so each sends the others a fingerprint of every file it will read, its size and
a hash of its bytes, and a rank whose data differ from rank 0's is named in one line.
"""
from __future__ import annotations

import glob
import hashlib
from collections.abc import Sequence

import numpy as np

from .errors import AgreedError, LlmzError
from .run.files import (
    HEADER_BYTES,
    HEADER_INTS,
    atomic_write,
    check_header,
    check_size,
    open_regular,
    read_array,
    read_header,
)
from .run.launch import agree, allgather

TOKENS_MAGIC = 20240520
TOKENS_VERSION = 1


# ---- token files ------------------------------------------------------------------------------------------
def write_tokens(path: str, tokens) -> None:
    """Write an llm.c token file (uint16 tokens) atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise LlmzError(f"{path}: tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise LlmzError(f"{path}: tokens must lie in 0..65535 to fit uint16, got {tokens.min()}..{tokens.max()}")
    if tokens.size >= 2**31:
        raise LlmzError(f"{path}: {tokens.size} tokens do not fit one file (int32 count); split them")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = TOKENS_MAGIC, TOKENS_VERSION, tokens.size
    atomic_write(path, [header, tokens.astype("<u2")])


def _open_tokens(path: str):
    """Open a token file and check its header against its size -> (file positioned at the tokens, count)."""
    f, raw, size = read_header(path, "token file")
    try:
        header = check_header(path, raw, TOKENS_MAGIC, "an llm.c token file")
        version, ntok = int(header[1]), int(header[2])
        if version != TOKENS_VERSION:
            raise LlmzError(f"{path}: unsupported version {version} (expected {TOKENS_VERSION})")
        if ntok < 0:
            raise LlmzError(f"{path}: bad token count {ntok} in the header")
        check_size(path, size, HEADER_BYTES + 2 * ntok, f"a header announcing {ntok} tokens")
    except BaseException:
        f.close()
        raise
    return f, ntok


def token_count(path: str) -> int:
    """The number of tokens of an llm.c token file, from its header checked against its size (reads no token)."""
    f, ntok = _open_tokens(path)
    f.close()
    return ntok


def read_tokens(path: str, vocab_size: int | None = None) -> np.ndarray:
    """Read an llm.c token file -> uint16 array, checking magic, version, count and exact size (header
    against fstat, before reading a token) and (if vocab_size is given) that every token is < vocab_size."""
    f, ntok = _open_tokens(path)
    with f:
        tokens = read_array(f, "<u2", ntok, path, "token file").astype(np.uint16, copy=False)
    if vocab_size is not None and ntok:
        bad = np.flatnonzero(tokens >= vocab_size)
        if bad.size:
            i = int(bad[0])
            raise LlmzError(f"{path}: token {tokens[i]} at position {i} is >= vocab size {vocab_size} "
                            f"({bad.size} such tokens; tokenized for another vocabulary?)")
    return tokens


def find_token_files(pattern: str) -> list[str]:
    """The files a --train-data / --val-data glob names, sorted; none is an error."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise LlmzError(f"{pattern}: no file matches")
    return files


# ---- every rank reads the same data ---------------------------------------------------------------------
WHOLE_HASH_BYTES = 64 << 20      # files up to this size are hashed whole (SHA-256: ~1.1 GB/s here, 60 ms)
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 64 << 10   # larger ones by 64 blocks of 64 KiB spread evenly, first and last


def fingerprint(path: str) -> tuple[int, str]:
    """(size, hash) of a data file: SHA-256 of its bytes (of its evenly spread blocks, header and end
    included, when it is larger than WHOLE_HASH_BYTES), and of its size. The same on every copy of a file,
    wherever it lies; names and times do not enter."""
    f, size = open_regular(path, "token file")
    h = hashlib.sha256(str(size).encode())
    with f:
        if size <= WHOLE_HASH_BYTES:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        else:
            for i in range(SAMPLE_BLOCKS):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BYTES))
    return size, h.hexdigest()[:16]


def check_same_data(ranks, data: dict[str, str]) -> None:
    """Every rank reads the same data: the files each flag's glob (data: {flag: glob}) names on this rank
    have the same sizes and hashes as rank 0's, in the same order; else every rank stops with one line naming
    the first rank and file that differ (AgreedError, exit status 2). A collective: every rank calls it."""
    if ranks.world_size == 1:
        return
    mine = agree(ranks, lambda: {flag: [(p, *fingerprint(p)) for p in find_token_files(pattern)]
                                 for flag, pattern in data.items() if pattern})
    views = allgather(ranks, mine)
    for r, view in enumerate(views[1:], start=1):
        for flag, files in view.items():
            ref = views[0][flag]
            if len(files) != len(ref):
                raise AgreedError(f"rank {r}'s {flag} names {len(files)} file(s), rank 0's {len(ref)}: every rank "
                                  f"must read the same data (a relative path from another folder?)", 2)
            for (p, size, digest), (p0, size0, digest0) in zip(files, ref):
                if (size, digest) != (size0, digest0):
                    raise AgreedError(f"rank {r}'s {flag} file {p} ({size} bytes, hash {digest}) differs from "
                                      f"rank 0's {p0} ({size0} bytes, hash {digest0}): every rank must read the "
                                      f"same data (a relative path from another folder, or copies that differ?)", 2)


# ---- the data loader --------------------------------------------------------------------------------------
class DataLoader:
    """Batches (x, y) of shape (B, T), int32, from llm.c token files, sharded across ranks as in llm.c.

    `pattern_or_paths` is a glob (expanded and sorted) or a list of paths. Unlike llm.c, which walks its
    shards one after another, the tokens of all files are concatenated into ONE stream (the files are
    small here), so a batch may span two files. Over that stream of N tokens there are
    n = (N - 1) // (P*B*T) batch positions; micro-batch i of rank r (of P) reads the B*T+1 tokens at

        offset = (i mod n) * P*B*T + r * B*T          (shuffle: perm_epoch[i mod n] in place of i mod n)

    x = those tokens[:-1], y = tokens[1:] (the next token of each). So the P ranks together read exactly
    the tokens a single rank would read with batch P*B: data parallelism equals a bigger batch.
    With shuffle=True the n positions are visited in a permutation drawn per epoch from
    default_rng([seed, epoch]), the same on every rank.
    """

    def __init__(self, pattern_or_paths: str | Sequence[str], B: int, T: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = False, seed: int = 0, vocab_size: int | None = None):
        if B <= 0 or T <= 0:
            raise LlmzError(f"batch size B={B} and sequence length T={T} must be positive")
        if not 0 <= rank < world_size:
            raise LlmzError(f"rank {rank} is outside a world of size {world_size}")
        if isinstance(pattern_or_paths, str):
            self.files = find_token_files(pattern_or_paths)
        else:
            self.files = list(pattern_or_paths)
            if not self.files:
                raise LlmzError("no token files given")
        parts = [read_tokens(p, vocab_size) for p in self.files]
        self.tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.stride = world_size * B * T                         # tokens all ranks consume per micro-batch
        self.num_batches = max((self.tokens.size - 1) // self.stride, 0)  # n
        if self.num_batches == 0:
            names = ", ".join(self.files)
            raise LlmzError(f"{names}: {self.tokens.size} tokens cannot fill one batch of "
                            f"world_size*B*T+1 = {world_size}*{B}*{T}+1 = {self.stride + 1} tokens")
        self._perm_epoch, self._perm = -1, None
        self.reset()

    def reset(self) -> None:
        """Back to the first micro-batch of epoch 0."""
        self.position = 0                                       # micro-batches consumed so far

    @property
    def epoch(self) -> int:
        return self.position // self.num_batches

    def batch_index(self, i: int) -> int:
        """Which of the n batch positions micro-batch i reads."""
        j = i % self.num_batches
        if not self.shuffle:
            return j
        epoch = i // self.num_batches
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_batches)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next (x, y), each a new (B, T) int32 array; wraps around after n micro-batches."""
        x, y = self.peek()
        self.position += 1
        return x, y

    def peek(self) -> tuple[np.ndarray, np.ndarray]:
        """The (x, y) that next_batch() returns next, without moving on."""
        B, T = self.B, self.T
        start = self.batch_index(self.position) * self.stride + self.rank * B * T
        buf = self.tokens[start:start + B * T + 1].astype(np.int32)
        # inputs are the first B*T tokens, targets the same shifted by one
        return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)

    def state(self) -> dict:
        """Everything needed to continue exactly where this loader is (the same on every rank)."""
        return {"position": self.position, "epoch": self.epoch, "num_batches": self.num_batches,
                "num_tokens": int(self.tokens.size), "B": self.B, "T": self.T,
                "world_size": self.world_size, "shuffle": self.shuffle, "seed": self.seed}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of a loader over the same data with the same B, T, world size."""
        mine = self.state()
        keys = ("num_tokens", "B", "T", "world_size", "shuffle", "seed")
        diff = [f"{k}={state.get(k)} (here {mine[k]})" for k in keys if state.get(k) != mine[k]]
        if diff:
            raise LlmzError(f"data loader state does not match this data/batch: {', '.join(diff)}")
        self.position = int(state["position"])
