"""The outputs a run writes: their names checked at start, the --log file, and who holds a lock.

`prepare_output` runs at start for every output a command line names (--save, --log, --trace,
--checkpoint-dir): it creates the parent folders, as tools of this kind do, and refuses a folder, a device,
an unwritable place or a name longer than the filesystem allows (NAME_MAX, PATH_MAX) in one line, before
any work the late failure would waste. Names llmz makes beside an output (a temporary file while writing
it, a lock) are cut to fit (llmz.files.fit_name), so every name that fits works. `JsonLog` is the --log
file: one JSON object a line, under its own name from the first record, flushed record by record;
`check_log` refuses a --log that holds anything else, so that no run truncates or trims a file that is not
its log. The files themselves are read and written through llmz.files.
"""
from __future__ import annotations

import fcntl
import json
import os

from ..errors import LlmzError
from ..files import TMP_TAIL, atomic_write, loads_json, name_limits, nbytes, open_regular

CHECKPOINT_ENTRY = os.path.join("step_000000000", "state_rank0000.bin.XXXXXXXX.tmp")


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
