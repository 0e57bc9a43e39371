"""Opening the files a user names, safely.

Reading: a FIFO, a device or a socket opened to be read blocks for ever or streams without end, and a huge
(or sparse) file read whole before its header is checked takes all the memory. So every reader of llmz's
files (models, tokens, tokenizers, training state) opens them through `open_regular`, which refuses all but
regular files (os.stat before opening, fstat after: a name swapped in between is caught too, and O_NONBLOCK
means even that open cannot block), reads the header, compares the size its header announces with the size
from fstat, and only then reads the payload, no more than announced, with `read_array` / `read_bytes`,
which first check that it fits in the memory available. Every error is one LlmzError naming the file.
llm.c's files open with a header of 256 int32, the first a magic number: `read_header`, `check_header`
(which names the file passed instead, by its magic) and `check_size` read and check it.

Every file llmz writes goes through `atomic_write`: the bytes go to a temporary name in the same folder,
which replaces the final name only once complete, so a crash never leaves a half-written file behind.

Writing: `prepare_output` runs at start for every output a command line names (--save, --log, --trace,
--checkpoint-dir): it creates the parent folders, as tools of this kind do, and refuses a folder, a device,
an unwritable place or a name longer than the filesystem allows (NAME_MAX, PATH_MAX) in one line, before
any work the late failure would waste. Names llmz makes beside an output (a temporary file while writing
it, a lock) are cut to fit (`fit_name`), so every name that fits works. `JsonLog` is the --log file: one
JSON object a line, under its own name from the first record, flushed record by record; `check_log` refuses
a --log that holds anything else, so that no run truncates or trims a file that is not its log.
"""
from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
import zlib
from collections.abc import Sequence

import numpy as np

from ..config import fmt_bytes
from ..errors import LlmzError

# what each kind of non-regular file is called in an error line
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
CHECKPOINT_ENTRY = os.path.join("step_000000000", "state_rank0000.bin.XXXXXXXX.tmp")


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


def check_name(path: str, flag: str, inside: str = "") -> None:
    """Refuse, at start, an output whose name the filesystem cannot hold: a name (of the file, or of a
    folder on its way) longer than NAME_MAX, or a path, with the longest name llmz writes beside it or
    `inside` it, longer than PATH_MAX."""
    full = os.path.abspath(path)
    folder = full if inside else os.path.dirname(full)
    name_max, path_max = name_limits(folder)
    for part in full.split(os.sep):
        if nbytes(part) > name_max:
            shown = part if len(part) <= 40 else part[:20] + "..." + part[-12:]
            raise LlmzError(f"{flag}: the name {shown} is {nbytes(part)} bytes long; this filesystem allows "
                            f"{name_max}")
    if inside:
        longest = nbytes(os.path.join(full, inside))
    else:
        name = os.path.basename(full)
        longest = nbytes(folder) + 1 + max(nbytes(name), min(nbytes(name) + TMP_TAIL, name_max))
    if longest >= path_max:          # PATH_MAX counts the terminating zero byte
        raise LlmzError(f"{flag}: the path {full[:40]}... is too long: the files llmz writes there would have "
                        f"paths of {longest} bytes; this system allows {path_max - 1}")


# ---- writing a whole file ----------------------------------------------------------------------------------
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
def _make_folder(folder: str, flag: str, path: str, create: bool = True) -> None:
    """Create `folder` (and its parents) and check it can be written in; create=False: check only that it
    could be (its nearest existing ancestor is a folder this process can write in), creating nothing."""
    if not create:
        at = os.path.abspath(folder)
        while not os.path.exists(at) and os.path.dirname(at) != at:
            at = os.path.dirname(at)
        if not os.path.isdir(at):
            raise LlmzError(f"{flag} {path}: cannot create the folder {folder} ({at} is not a folder)")
        folder = at
    else:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise LlmzError(f"{flag} {path}: cannot create the folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LlmzError(f"{flag} {path}: cannot write in {folder} (permission denied)")


def make_folders(folder: str) -> list[str]:
    """os.makedirs(folder), returning the folders it created, deepest first (remove_folders undoes it)."""
    made, at = [], os.path.abspath(folder)
    while not os.path.exists(at) and os.path.dirname(at) != at:
        made.append(at)
        at = os.path.dirname(at)
    os.makedirs(folder, exist_ok=True)
    return made


def remove_folders(made: list[str]) -> None:
    """Remove the folders make_folders created, where still empty: a command that failed leaves nothing."""
    for folder in made:
        try:
            os.rmdir(folder)
        except OSError:
            return


def prepare_output(path: str, flag: str, create: bool = True) -> None:
    """At start, for an output FILE a flag names: refuse a folder or a non-regular file under that name,
    create the parent folders, and check that they can be written to (create=False: that they could be
    created; the command makes them when it writes, so that a failure before leaves nothing behind)."""
    if not path:
        raise LlmzError(f"{flag}: empty file name")
    check_name(path, flag)
    if flag == "--trace":                  # llmz.trace writes its picture beside the trace, FILE.png
        check_name(os.path.splitext(path)[0] + ".png", flag)
    if os.path.isdir(path):
        raise LlmzError(f"{flag} {path}: is a folder; name a file")
    if os.path.exists(path) and not os.path.isfile(path):
        raise LlmzError(f"{flag} {path}: exists and is not a regular file (a device or FIFO?); name a file")
    _make_folder(os.path.dirname(os.path.abspath(path)), flag, path, create)


def prepare_folder(path: str, flag: str, create: bool = True) -> None:
    """At start, for an output FOLDER a flag names (--checkpoint-dir): create it (and its parents); refuse a
    file there, or a path so long that the files a checkpoint writes inside would not fit PATH_MAX.
    create=False: check that it could be created, as prepare_output."""
    if not path:
        raise LlmzError(f"{flag}: empty folder name")
    check_name(path, flag, inside=CHECKPOINT_ENTRY)
    if os.path.exists(path) and not os.path.isdir(path):
        raise LlmzError(f"{flag} {path}: exists and is not a folder")
    _make_folder(path, flag, path, create)


def holder(path: str) -> str:
    """Who holds a lock (flock) on the file at `path`, from /proc/locks: "pid N", or "" if unknown."""
    try:
        st = os.stat(path)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:                  # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
                fields = line.split()
                if "FLOCK" in fields:
                    i = fields.index("FLOCK")
                    if fields[i + 4:i + 5] == [inode]:
                        return f"pid {fields[i + 3]}"
    except (OSError, ValueError):
        pass
    return ""


def _flock(f, path: str, what: str) -> None:
    """Hold an exclusive lock on the file itself (its inode: every name of it, a symlink, a hard link, another
    spelling, reaches the same lock; the kernel drops it when the process ends, however it ends)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = holder(path)
        raise LlmzError(f"{what} is in use by another run{f' ({who})' if who else ''}, which writes the same file "
                        f"under another name (a symlink or hard link?): wait for it to finish, or choose "
                        f"another") from None
    except OSError:
        pass                                    # a filesystem without locks: the lock file guards alone


def check_not_written(path: str, what: str) -> None:
    """Refuse, at start, a file that another run writes now, under whatever name (its JsonLog holds it)."""
    try:
        f = open(path, "rb")                    # noqa: SIM115  (closed below; a regular file: checked at start)
    except OSError:
        return
    with f:
        _flock(f, path, what)


def check_log(path: str, flag: str = "--log") -> None:
    """Refuse, at start, a --log that exists and is not an llmz log: a run starts its log afresh and a resume
    trims what a failed attempt wrote, so either would destroy a file of the user's. An llmz log is one JSON
    object a line, the first a start record; the last line may be torn (a crash while writing it)."""
    try:
        f, size = open_regular(path, "log")
    except LlmzError:
        return                                  # none yet (or not readable: prepare_output says so)
    with f:
        n = 0
        while line := f.readline(1 << 20):
            n += 1
            try:
                rec = loads_json(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict) and (n > 1 or rec.get("event") == "start"):
                continue
            if not line.endswith(b"\n") and f.tell() == size and (n > 1 or line.startswith(b'{"event": "start"')):
                return                          # a torn last line, left by a crash
            shown = line[:40].decode("utf-8", "replace").strip()
            raise LlmzError(f"{flag} {path}: not an llmz log (line {n}, {shown!r}, is not "
                            f"{'a start record' if n == 1 else 'a JSON record'}); a run would overwrite it, a "
                            f"resume trim it: name another file")


class JsonLog:
    """The --log file: one JSON object a line, under its own name from the first record, flushed after
    every record (a crash or kill -9 loses at most the line being written).

    As llm.c's logger: a new run starts the file afresh; a resumed run continues it, after dropping what an
    earlier attempt wrote past the step it resumes from (it trained steps that no checkpoint holds any more,
    and this run writes those steps again): step and val records of steps >= S, checkpoint records after S,
    end records, and a torn last line. `dropped` counts them. The file is locked (flock) while it is open:
    a second run that names it otherwise (a symlink, a hard link) is refused, and nothing is truncated or
    trimmed before the lock is held. run_id: the resuming run's; a log whose last start record names another
    run is not this run's to trim (llmz.run.state.check_run_identity refused it at start): refused here too."""

    def __init__(self, path: str, resume_step: int | None = None, run_id: str | None = None):
        self.path, self.dropped, self.run_id = path, 0, run_id
        what = f"log {path}"
        try:
            self.f = open(path, "a")            # noqa: SIM115  (closed by close()); truncated once locked
            _flock(self.f, path, what)
            if resume_step is None:
                self.f.truncate(0)
            elif self._drop_after(resume_step):  # rewritten whole (a new file under the name): lock that one
                old, self.f = self.f, open(path, "a")      # noqa: SIM115
                old.close()
                _flock(self.f, path, what)
        except OSError as e:
            raise LlmzError(f"{path}: cannot write the log ({e.strerror or e})") from None

    def _drop_after(self, step: int) -> int:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        keep, theirs = [], None
        for i, line in enumerate(lines):
            try:
                rec = loads_json(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict) and i < len(lines) - 1:    # check_log refused these at start
                raise LlmzError(f"{self.path}: line {i + 1} is not a log record (changed since the start?)")
            if isinstance(rec, dict) and rec.get("event") == "start":
                theirs = rec.get("run_id")
            past = not isinstance(rec, dict) or rec.get("event") == "end" or (
                isinstance(rec.get("step"), int) and (rec["step"] > step if rec.get("event") == "checkpoint"
                                                      else rec["step"] >= step))
            if past:
                self.dropped += 1
            else:
                keep.append(line + "\n")
        if self.dropped and isinstance(theirs, str) and self.run_id and theirs != self.run_id:
            raise LlmzError(f"{self.path}: the log of run {theirs}, not of this run ({self.run_id}): not trimmed; "
                            f"name a new --log")
        if self.dropped:
            atomic_write(self.path, ["".join(keep).encode()])
        return self.dropped

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
