"""Reading and writing llmz's files safely (llm.c's model, token and tokenizer files, the training state, the
timeline): the foundation every file format of llmz stands on.

Reading: a FIFO, a device or a socket opened to be read blocks for ever or streams without end, and a huge
(or sparse) file read whole before its header is checked takes all the memory. So every reader of llmz's
files (models, tokens, tokenizers, training state) opens them through `open_regular`, which refuses all but
regular files (os.stat before opening, fstat after: a name swapped in between is caught too, and O_NONBLOCK
means even that open cannot block), reads the header, compares the size its header announces with the size
from fstat, and only then reads the payload, no more than announced, with `read_array` / `read_bytes`,
which first check that it fits in the memory available. Every error is one LlmzError naming the file.
llm.c's files open with a header of 256 int32, the first a magic number: `read_header`, `check_header`
(which names the file passed instead, by its magic) and `check_size` read and check it.

Writing: every file llmz writes goes through `atomic_write`: the bytes go to a temporary name in the same
folder, which replaces the final name only once complete, so a crash never leaves a half-written file
behind; the temporary name is cut to fit the filesystem (`fit_name`, `name_limits`), so every name that fits
works. What a run checks of the outputs its command line names, before any work, is llmz.run.outputs'.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
import zlib
from collections.abc import Sequence

import numpy as np

from .config import fmt_bytes
from .errors import LlmzError

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _must_be_regular(path: str, st: os.stat_result, what: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise LlmzError(f"{path}: is a folder, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise LlmzError(f"{path}: is {kind}, not a regular file; a {what} must be a regular file")


def open_regular(path: str, what: str):
    """Open `path` to read bytes, refusing anything but a regular file -> (binary file object, its size in
    bytes from fstat). `what` names the kind of file in errors ("model file", "token file", ...)."""
    try:
        _must_be_regular(path, os.stat(path), what)
        # O_NONBLOCK: had a FIFO replaced the file since the stat, this open returns at once (then fstat
        # refuses it); on a regular file the flag changes nothing
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise LlmzError(f"{path}: no such {what}") from None
    except OSError as e:
        raise LlmzError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(fd)
        _must_be_regular(path, st, what)
    except BaseException:
        f.close()
        raise
    return f, st.st_size


def available_memory() -> int | None:
    """Bytes of memory a new allocation can take without swapping (Linux: MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(nbytes: int, what: str) -> None:
    """Refuse, in one line starting with `what`, to allocate more bytes than the memory available."""
    free = available_memory()
    if free is not None and nbytes > free:
        raise LlmzError(f"{what} needs {fmt_bytes(nbytes)} of memory, {fmt_bytes(free)} is available")


def read_bytes(f, n: int, path: str, what: str) -> bytes:
    """Exactly n bytes from the file's position (the header said so and fstat agreed): memory checked first;
    a file that shrank meanwhile is an error, not a short read."""
    check_memory(n, f"{path}: reading this {what}")
    try:
        raw = f.read(n)
    except MemoryError:
        raise LlmzError(f"{path}: out of memory reading {fmt_bytes(n)} of this {what}") from None
    except OSError as e:
        raise LlmzError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if len(raw) != n:
        raise LlmzError(f"{path}: truncated while reading: {len(raw)} of {n} bytes (did the file change?)")
    return raw


HASH_CHUNK = 64 << 20       # read_array with a hash: bytes read while the previous piece is hashed


def read_array(f, dtype, count: int, path: str, what: str, hasher=None):
    """`count` values of `dtype` from the file's position, into a new NumPy array, read in place. hasher (a
    hashlib object): updated with the bytes as they come, each HASH_CHUNK piece hashed by a thread while the
    next is read (hashlib lets go of the GIL), so that the digest costs about what the slower of the two costs."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    check_memory(nbytes, f"{path}: reading this {what}")
    try:
        out = np.empty(count, dtype)
    except MemoryError:
        raise LlmzError(f"{path}: out of memory reading {fmt_bytes(nbytes)} of this {what}") from None
    read_into(f, memoryview(out).cast("B"), path, what, hasher)
    return out


def read_into(f, view: memoryview, path: str, what: str, hasher=None) -> None:
    """Fill the bytes of `view` from the file's position (read_array's loop; hasher as there)."""
    from concurrent.futures import ThreadPoolExecutor
    nbytes, at = len(view), 0
    pool = ThreadPoolExecutor(1, thread_name_prefix="llmz-hash") if hasher is not None else None
    hashed = []
    try:
        while at < nbytes:
            got = f.readinto(view[at:at + HASH_CHUNK] if pool else view[at:])
            if not got:
                raise LlmzError(f"{path}: truncated while reading: {at} of {nbytes} payload bytes "
                                "(did the file change?)")
            if pool:
                hashed.append(pool.submit(hasher.update, view[at:at + got]))     # in order: one thread
            at += got
    except OSError as e:
        raise LlmzError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    finally:
        if pool:
            pool.shutdown(wait=True)
    for h in hashed:
        h.result()


def loads_json(text):
    """json.loads, where a text nested too deep for Python's parser (a file of 100,000 brackets raises
    RecursionError) is a json.JSONDecodeError like any other bad JSON: every reader's one line covers it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply for this reader", text if isinstance(text, str) else "",
                                   0) from None


# ---- llm.c's headers: 256 int32, the first a magic number -------------------------------------------------
HEADER_INTS = 256                 # every llm.c header is 256 x 4 bytes
HEADER_BYTES = 4 * HEADER_INTS
# Magic numbers of llm.c's files, to tell a user which file they passed instead of the right one.
KNOWN_MAGICS = {20240326: "an llm.c model file", 20240328: "an llm.c tokenizer file",
                20240520: "an llm.c token file", 20240527: "an llm.c training-state file",
                20261203: "an llmz training-state file"}


def read_header(path: str, what: str):
    """Open a regular file and read its header -> (open file positioned after the header, header bytes,
    file size from fstat). A file shorter than the header gives the bytes it has (check_header refuses it)."""
    f, size = open_regular(path, what)
    try:
        raw = read_bytes(f, min(size, HEADER_BYTES), path, what)
    except BaseException:
        f.close()
        raise
    return f, raw, size


def check_header(path: str, raw: bytes, magic: int, what: str, dtype: str = "<i4") -> np.ndarray:
    """The 256-entry header of `raw`, after checking the file is long enough and the magic number."""
    if len(raw) < HEADER_BYTES:
        raise LlmzError(f"{path}: truncated: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype=dtype, count=HEADER_INTS)
    if int(header[0]) != magic:
        found = int(header[0])
        hint = f"this is {KNOWN_MAGICS[found]}" if found in KNOWN_MAGICS else f"not {what}"
        raise LlmzError(f"{path}: bad magic {found} (expected {magic}; {hint})")
    return header


def check_size(path: str, actual: int, expected: int, detail: str) -> None:
    """One line for a file whose size does not match what its header promises."""
    if actual < expected:
        raise LlmzError(f"{path}: truncated: {actual} bytes, {detail} needs {expected}")
    if actual > expected:
        raise LlmzError(f"{path}: wrong size: {actual} bytes, {detail} needs {expected} "
                        f"({actual - expected} extra bytes)")


# ---- names: what the filesystem allows ------------------------------------------------------------------------
TMP_SUFFIX = ".tmp"
TMP_TAIL = len(".XXXXXXXX" + TMP_SUFFIX)    # what atomic_write's temporary name adds to a name
# the longest path llmz writes inside a --checkpoint-dir (llmz.run.state: a step folder, a rank's state, its
# temporary name), with room for a billion steps and ten thousand ranks
def name_limits(folder: str) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) in bytes of the filesystem of `folder` (of its nearest existing parent when it
    does not exist yet): the longest name a folder there holds, the longest path a call accepts."""
    folder = os.path.abspath(folder)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    limits = []
    for name, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limits.append(os.pathconf(folder, name) or default)
        except (OSError, ValueError):
            limits.append(default)
    return limits[0], limits[1]


def nbytes(name: str) -> int:
    """The length of a name as the filesystem counts it: bytes, not characters."""
    return len(os.fsencode(name))


def cut_name(name: str, limit: int) -> str:
    """`name`, shortened (by whole characters) to at most `limit` bytes."""
    while nbytes(name) > limit:
        name = name[:-1]
    return name


def fit_name(path: str, suffix: str) -> str:
    """`path + suffix` when its name fits the folder's NAME_MAX; else the name cut short, with a hash of the
    whole name (so two long names that begin alike stay apart), then the suffix: a lock or a side file of
    any output whose own name fits."""
    folder, name = os.path.split(path)
    limit = name_limits(folder or ".")[0]
    if nbytes(name + suffix) <= limit:
        return path + suffix
    tag = f".{zlib.crc32(os.fsencode(name)):08x}"
    return os.path.join(folder, cut_name(name, limit - nbytes(tag + suffix)) + tag + suffix)


def _write_part(f, part) -> None:
    """Write one piece (bytes or a contiguous array) to an open binary file."""
    f.write(memoryview(np.ascontiguousarray(part)).cast("B") if isinstance(part, np.ndarray) else part)


def atomic_write(path: str, parts: Sequence) -> None:
    """Write `parts` (bytes / arrays, in order) to `path` through a temporary file and os.replace.
    A failure leaves any previous file at `path` untouched and removes the temporary file."""
    folder = os.path.dirname(os.path.abspath(path))
    # NAME.XXXXXXXX.tmp, NAME cut short where the whole would not fit the folder's NAME_MAX
    prefix = cut_name(os.path.basename(path), name_limits(folder)[0] - TMP_TAIL) + "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=TMP_SUFFIX, dir=folder)
    except OSError as e:
        raise LlmzError(f"{path}: cannot write ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)   # mkstemp's file is private (0600): give it the usual mode
            for part in parts:
                _write_part(f, part)
            f.flush()
            os.fsync(f.fileno())        # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise LlmzError(f"{path}: cannot write ({e.strerror or e})") from None
        raise


# ---- outputs ------------------------------------------------------------------------------------------------
