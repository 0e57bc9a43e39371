"""llm.c token files and the data loader that cuts them into (B, T) batches, exactly as llm.c does.

Token file: a header of 256 int32 ([0]=20240520 magic, [1]=1 version, [2]=number of tokens), then the
tokens as uint16; its size is exactly 1024 + 2 * ntok bytes.

A run knows its data by content: the DataLoader takes the SHA-256 of every token file's bytes (all of
them, header included: what `sha256sum FILE` prints) while it reads the file, the reading and the hashing
overlapped. The ranks agree on it before any step (`check_same_data`): each rank reads its own files (a
relative glob, node-local copies), so each sends the others the name, size and digest of every file it
reads, and a rank whose data differ from rank 0's is named in one line. Checkpoints keep the digests, and a
resume compares them (llmz.run.checkpoints.check_data).
"""
from __future__ import annotations

import glob
import hashlib
from collections.abc import Sequence

import numpy as np

from .errors import AgreedError, LlmzError
from .files import (
    HEADER_BYTES,
    HEADER_INTS,
    atomic_write,
    check_header,
    check_size,
    open_regular,
    read_array,
    read_header,
)

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
    """Open a token file and check its header against its size -> (file positioned at the tokens, count, the
    header's bytes)."""
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
    return f, ntok, raw


def token_count(path: str) -> int:
    """The number of tokens of an llm.c token file, from its header checked against its size (reads no token)."""
    f, ntok, _ = _open_tokens(path)
    f.close()
    return ntok


def read_tokens(path: str, vocab_size: int | None = None, hasher=None) -> np.ndarray:
    """Read an llm.c token file -> uint16 array, checking magic, version, count and exact size (header
    against fstat, before reading a token) and (if vocab_size is given) that every token is < vocab_size.
    hasher (a hashlib object): updated with every byte of the file, header first, as it is read."""
    f, ntok, header = _open_tokens(path)
    with f:
        if hasher is not None:
            hasher.update(header)
        tokens = read_array(f, "<u2", ntok, path, "token file", hasher).astype(np.uint16, copy=False)
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
DIGEST = "sha256"                 # hashlib's name of the digest every token file is known by
SHOWN = 16                        # hex digits of a digest shown in a line (all 64 are kept)


def file_digest(path: str) -> tuple[int, str]:
    """(size, SHA-256 hex digest) of a file's bytes, read in pieces: what `sha256sum` prints. (The DataLoader
    takes the same digest while it reads a token file, without a second pass.)"""
    h = hashlib.new(DIGEST)
    f, size = open_regular(path, "token file")
    with f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return size, h.hexdigest()


def check_same_data(ranks, loaders: dict) -> dict[str, list[list]]:
    """Every rank reads the same data: the files of each loader ({flag: DataLoader or None}) on this rank have
    the sizes and digests of rank 0's, in the same order; else every rank stops with one line naming the first
    rank and file that differ (AgreedError, exit status 2). Returns the data as rank 0 names it, {flag: [[name,
    size, digest], ...]}: what a checkpoint keeps. A collective: every rank calls it."""
    mine = {flag: [list(d) for d in loader.digests] for flag, loader in loaders.items() if loader is not None}
    if ranks.world_size == 1:
        return mine
    views = ranks.allgather(mine)
    for r, view in enumerate(views[1:], start=1):
        for flag, files in view.items():
            ref = views[0][flag]
            if len(files) != len(ref):
                raise AgreedError(f"rank {r}'s {flag} names {len(files)} file(s), rank 0's {len(ref)}: every rank "
                                  f"must read the same data (a relative path from another folder?)", 2)
            for (p, size, digest), (p0, size0, digest0) in zip(files, ref):
                if (size, digest) != (size0, digest0):
                    raise AgreedError(f"rank {r}'s {flag} file {p} ({size} bytes, {DIGEST} {digest[:SHOWN]}) differs "
                                      f"from rank 0's {p0} ({size0} bytes, {DIGEST} {digest0[:SHOWN]}): every rank "
                                      f"must read the same data (a relative path from another folder, or copies "
                                      f"that differ?)", 2)
    return views[0]


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
        parts, self.digests = [], []          # digests: (name, size, SHA-256) of each file, as read
        for p in self.files:
            h = hashlib.new(DIGEST)
            parts.append(read_tokens(p, vocab_size, h))
            self.digests.append((p, HEADER_BYTES + 2 * parts[-1].size, h.hexdigest()))
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
