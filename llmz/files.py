"""Opening the files a user names, safely.

Reading: a FIFO, a device or a socket opened to be read blocks for ever or streams without end, and a huge
(or sparse) file read whole before its header is checked takes all the memory. So every reader of llmz's
files (models, tokens, tokenizers, training state) opens them through `open_regular`, which refuses all but
regular files (os.stat before opening, fstat after: a name swapped in between is caught too, and O_NONBLOCK
means even that open cannot block), reads the header, compares the size its header announces with the size
from fstat, and only then reads the payload, no more than announced, with `read_array` / `read_bytes`,
which first check that it fits in the memory available. Every error is one LlmzError naming the file.

Writing: `prepare_output` runs at start for every output a command line names (--save, --log, --trace,
--checkpoint-dir): it creates the parent folders, as tools of this kind do, and refuses a folder, a device
or an unwritable place in one line, before any work the late failure would waste. `JsonLog` is the --log
file: one JSON object a line, under its own name from the first record, flushed record by record.
"""
from __future__ import annotations

import json
import os
import stat

from .errors import LlmzError

# what each kind of non-regular file is called in an error line
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def fmt_bytes(n: float) -> str:
    from .memory import fmt_bytes
    return fmt_bytes(n)


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


def read_array(f, dtype, count: int, path: str, what: str):
    """`count` values of `dtype` from the file's position, into a new NumPy array, read in place."""
    import numpy as np
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    check_memory(nbytes, f"{path}: reading this {what}")
    try:
        out = np.empty(count, dtype)
    except MemoryError:
        raise LlmzError(f"{path}: out of memory reading {fmt_bytes(nbytes)} of this {what}") from None
    view, at = memoryview(out).cast("B"), 0
    try:
        while at < nbytes:
            got = f.readinto(view[at:])
            if not got:
                raise LlmzError(f"{path}: truncated while reading: {at} of {nbytes} payload bytes "
                                "(did the file change?)")
            at += got
    except OSError as e:
        raise LlmzError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    return out


# ---- outputs ------------------------------------------------------------------------------------------------
def _make_folder(folder: str, flag: str, path: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise LlmzError(f"{flag} {path}: cannot create the folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LlmzError(f"{flag} {path}: cannot write in {folder} (permission denied)")


def prepare_output(path: str, flag: str) -> None:
    """At start, for an output FILE a flag names: refuse a folder or a non-regular file under that name,
    create the parent folders, and check that they can be written to."""
    if not path:
        raise LlmzError(f"{flag}: empty file name")
    if os.path.isdir(path):
        raise LlmzError(f"{flag} {path}: is a folder; name a file")
    if os.path.exists(path) and not os.path.isfile(path):
        raise LlmzError(f"{flag} {path}: exists and is not a regular file (a device or FIFO?); name a file")
    _make_folder(os.path.dirname(os.path.abspath(path)), flag, path)


def prepare_folder(path: str, flag: str) -> None:
    """At start, for an output FOLDER a flag names: create it (and its parents); refuse a file there."""
    if not path:
        raise LlmzError(f"{flag}: empty folder name")
    if os.path.exists(path) and not os.path.isdir(path):
        raise LlmzError(f"{flag} {path}: exists and is not a folder")
    _make_folder(path, flag, path)


class JsonLog:
    """The --log file: one JSON object a line, under its own name from the first record, flushed after
    every record (a crash or kill -9 loses at most the line being written).

    As llm.c's logger: a new run starts the file afresh ("w"); a resumed run continues it ("a"), after
    dropping what an earlier attempt wrote past the step it resumes from (it trained steps that no
    checkpoint holds any more, and this run writes those steps again): step and val records of steps >= S,
    checkpoint records after S, end records, and a torn last line. `dropped` counts them."""

    def __init__(self, path: str, resume_step: int | None = None):
        self.path, self.dropped = path, 0
        try:
            if resume_step is not None and os.path.isfile(path):
                self._drop_after(resume_step)
            self.f = open(path, "a" if resume_step is not None else "w")   # noqa: SIM115  (closed by close())
        except OSError as e:
            raise LlmzError(f"{path}: cannot write the log ({e.strerror or e})") from None

    def _drop_after(self, step: int) -> None:
        from .data import atomic_write
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        keep = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            past = not isinstance(rec, dict) or rec.get("event") == "end" or (
                isinstance(rec.get("step"), int) and (rec["step"] > step if rec.get("event") == "checkpoint"
                                                      else rec["step"] >= step))
            if past:
                self.dropped += 1
            else:
                keep.append(line + "\n")
        if self.dropped:
            atomic_write(self.path, ["".join(keep).encode()])

    def write(self, record: dict) -> None:
        try:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()
        except OSError as e:
            raise LlmzError(f"{self.path}: cannot write the log ({e.strerror or e})") from None

    def close(self) -> None:
        if not self.f.closed:
            try:
                self.f.close()
            except OSError as e:
                raise LlmzError(f"{self.path}: cannot write the log ({e.strerror or e})") from None
