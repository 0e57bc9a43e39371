"""Lock files: which live run writes a checkpoint folder or a --log file.

Two runs on one checkpoint folder replace each other's checkpoints (and prune each other's with --keep);
two runs on one --log interleave their lines. So rank 0 of a run holds

    DIR/llmz.lock          for --checkpoint-dir DIR (inside it: every spelling of DIR, a symlink to it
                           included, reaches this one file)
    FILE.jsonl.lock        for --log FILE.jsonl, beside the file the name resolves to (symlinks followed,
                           so `alias.jsonl -> FILE.jsonl` and `DIR/./FILE.jsonl` share it); and while the
                           log is open, a lock on the log file itself (flock, llmz.run.outputs.JsonLog), which a
                           hard link or any other name reaches too

from the start to the end of training: one JSON line with the owner's pid, host, start time and, on Linux,
the process's start tick (so a pid reused by another process does not look like the owner). The lock is
taken with O_CREAT | O_EXCL, which is atomic. A lock whose owner is gone (same host, no live process with
that pid and start tick, or a zombie: the run was killed or crashed, its process not yet reaped) is stale: it
is reported in a note and taken over at once, never silently. A lock held by a live process, or left by another host (where this one cannot check), is
refused with a line that says whose it is.
"""
from __future__ import annotations

import json
import os
import socket
import time

from ..errors import LlmzError, UsageError
from ..files import fit_name, loads_json
from .environment import process_state
from .outputs import check_log, check_not_written


def _alive(owner: dict) -> bool:
    """Does the lock's owner still run? Not when its pid is gone, is a zombie (killed or crashed, not yet
    reaped: under mpiexec a dead rank stays one for a moment), or belongs to a process started later."""
    state, tick = process_state(owner.get("pid"))
    if state in (None, "Z", "X"):
        return False
    return owner.get("tick") is None or tick is None or tick == owner["tick"]


def _describe(owner: dict) -> str:
    since = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {owner.get('pid')} on {owner.get('host')}, since {when}"


class Lock:
    """`Lock(path, what).acquire()` takes the lock (returns a note if it took over a stale one, else None);
    `release()` removes it. `what` says what the lock guards, for the error lines."""

    def __init__(self, path: str, what: str):
        self.path, self.what, self.held = path, what, False

    def _me(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "tick": process_state(os.getpid())[1]}

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise LlmzError(f"{self.path}: cannot create the lock file of {self.what} ({e.strerror or e})") from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self._me()) + "\n")
        self.held = True
        return True

    def _owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                owner = loads_json(f.read(4096) or "null")
            return owner if isinstance(owner, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> str | None:
        for _ in range(3):           # another run may take over or release between our steps: look again
            if self._create():
                return None
            owner = self._owner()
            if owner is None:        # released meanwhile
                continue
            if not owner.get("host"):   # not a lock record: damaged, or written this instant by another run
                raise LlmzError(f"{self.what} is locked, but its lock file {self.path} names no owner (damaged, or "
                                f"another run writing it this instant): if no run uses it, delete {self.path}")
            if owner.get("host") != socket.gethostname():
                raise LlmzError(f"{self.what} is locked by {_describe(owner)} ({self.path}); another host "
                                f"cannot tell from here whether that run still lives: if it does not, "
                                f"delete {self.path}")
            if _alive(owner):
                raise LlmzError(f"{self.what} is in use by another run ({_describe(owner)}; lock file "
                                f"{self.path}): wait for it to finish, or choose another")
            # stale: move it aside under a name of our own (atomic: of two runs taking over, one wins),
            # then take the lock as usual
            aside = fit_name(self.path, f".stale.{os.getpid()}")
            try:
                os.replace(self.path, aside)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise LlmzError(f"{self.path}: cannot replace the stale lock of {self.what} "
                                f"({e.strerror or e})") from None
            moved = Lock(aside, self.what)._owner()
            if moved != owner:       # another run took the stale lock over first: what we moved is its own
                try:
                    os.link(aside, self.path)
                except OSError:
                    pass
                os.unlink(aside)
                raise LlmzError(f"{self.what} is in use by another run ({_describe(moved or {})}; lock file "
                                f"{self.path}): wait for it to finish, or choose another")
            os.unlink(aside)
            if self._create():
                return (f"note: {self.what} was locked by {_describe(owner)}, which no longer runs (killed or "
                        f"crashed?); took the lock over")
        raise LlmzError(f"{self.path}: could not take the lock of {self.what} (other runs keep taking it)")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except OSError:
                pass


def take_locks(args, locks: list) -> list[str]:
    """Rank 0 of llmz.train, at start: lock --checkpoint-dir and --log for this run (appending each Lock taken
    to `locks`, released at the end, also on failure) and refuse a --log that is not an llmz log or that
    another run writes under another name. Returns the notes of stale locks taken over. Refusals are
    UsageErrors: exit status 2, before any work."""
    notes = []
    wanted = []
    if args.checkpoint_dir:
        wanted.append((os.path.join(args.checkpoint_dir, "llmz.lock"), f"checkpoint folder {args.checkpoint_dir}"))
    if args.log:
        wanted.append((fit_name(os.path.realpath(args.log), ".lock"), f"log {args.log}"))
    try:
        for path, what in wanted:
            lock = Lock(path, what)
            note = lock.acquire()
            locks.append(lock)
            if note:
                notes.append(note)
        if args.log:
            check_not_written(args.log, f"log {args.log}")
            check_log(args.log)
    except UsageError:
        raise
    except LlmzError as e:
        raise UsageError(str(e)) from None
    return notes
