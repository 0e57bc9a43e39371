"""Lock files: which live run writes a checkpoint folder or a --log file.

Two runs on one checkpoint folder replace each other's checkpoints (and prune each other's with --keep);
two runs on one --log interleave their lines. So rank 0 of a run holds

    DIR/llmz.lock          for --checkpoint-dir DIR
    FILE.jsonl.lock        for --log FILE.jsonl

from the start to the end of training: one JSON line with the owner's pid, host, start time and, on Linux,
the process's start tick (so a pid reused by another process does not look like the owner). The lock is
taken with O_CREAT | O_EXCL, which is atomic. A lock whose owner is gone (same host, no live process with
that pid and start tick: the run was killed or crashed) is stale: it is reported in a note and taken over,
never silently. A lock held by a live process, or left by another host (where this one cannot check), is
refused with a line that says whose it is.
"""
from __future__ import annotations

import json
import os
import socket
import time

from .errors import LlmzError


def _start_tick(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(owner: dict) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                                    # it exists, under another user
    tick = owner.get("tick")
    return tick is None or _start_tick(pid) in (None, tick)


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
                "tick": _start_tick(os.getpid())}

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
                owner = json.loads(f.read(4096) or "null")
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
            if owner.get("host") != socket.gethostname():
                raise LlmzError(f"{self.what} is locked by {_describe(owner)} ({self.path}); another host "
                                f"cannot tell from here whether that run still lives: if it does not, "
                                f"delete {self.path}")
            if _alive(owner):
                raise LlmzError(f"{self.what} is in use by another run ({_describe(owner)}; lock file "
                                f"{self.path}): wait for it to finish, or choose another")
            # stale: move it aside under a name of our own (atomic: of two runs taking over, one wins),
            # then take the lock as usual
            aside = f"{self.path}.stale.{os.getpid()}"
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
