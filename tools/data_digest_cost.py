"""What knowing a run's data by content costs: the SHA-256 of every byte of a token file, taken while it is read.

    python tools/data_digest_cost.py [--gb 10] [--dir /work/tmp] [--rounds 2]

Writes a file of --gb GB (a 64 MiB random block over and over: the disk and the hash see every byte; the
page cache is dropped for this file alone with posix_fadvise, so a "cold" read comes from the disk), then
reads it the way llmz.data.DataLoader does (llmz.files.read_into, in 1 GiB pieces into one buffer, so that a
file larger than a token file may hold, 2^31 tokens, fits in memory) with and without the hash, cold and
warm, alternating, and prints the seconds and the digest's cost: the extra seconds, once, at the start of a
run. The file is deleted at the end. An llm.c token file holds at most 2^31 - 1 tokens (4 GiB): 10 GB of
data is three or more files of a glob, read one after another the same way.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmz.files import read_into

PIECE = 1 << 30


def write_file(path: Path, nbytes: int) -> float:
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read(path: Path, digest: bool, buf: memoryview) -> tuple[float, str | None]:
    """Read the whole file through llmz.files.read_into, 1 GiB at a time -> (seconds, hex digest or None)."""
    h = hashlib.sha256() if digest else None
    size = path.stat().st_size
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        at = 0
        while at < size:
            n = min(PIECE, size - at)
            read_into(f, buf[:n], str(path), "token file", h)
            at += n
    return time.perf_counter() - t0, h.hexdigest() if h else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=10.0, help="file size in GB (10^9 bytes)")
    p.add_argument("--dir", default="/work/tmp", help="where the file is written (and deleted)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = Path(args.dir) / "digest_cost.bin"
    nbytes = int(args.gb * 1e9)
    print(f"load before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    try:
        print(f"wrote {nbytes / 1e9:.1f} GB in {write_file(path, nbytes):.1f} s")
        buf = memoryview(np.empty(PIECE, np.uint8)).cast("B")
        # the hash alone, on bytes in memory: its rate on this CPU
        t0 = time.perf_counter()
        hashlib.sha256(buf).hexdigest()
        print(f"sha256 of 1 GiB in memory: {time.perf_counter() - t0:.2f} s "
              f"({PIECE / (time.perf_counter() - t0) / 1e9:.2f} GB/s)")
        rows = {}
        for r in range(args.rounds):
            for cold in (True, False):
                for digest in (False, True):
                    if cold:
                        drop_cache(path)
                    secs, hexd = read(path, digest, buf)
                    rows.setdefault((cold, digest), []).append(secs)
                    print(f"round {r}: {'cold' if cold else 'warm'} read{' + sha256' if digest else ''}: "
                          f"{secs:.1f} s ({nbytes / secs / 1e9:.2f} GB/s){'  ' + hexd[:16] if hexd else ''}  "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
        for cold in (True, False):
            plain, hashed = min(rows[(cold, False)]), min(rows[(cold, True)])
            print(f"{'cold' if cold else 'warm'}: read {plain:.1f} s, read + sha256 {hashed:.1f} s (best of "
                  f"{args.rounds}): the digest adds {hashed - plain:+.1f} s once at start")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
