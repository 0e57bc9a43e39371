"""A collective that never returns: every collective between ranks has a deadline, --collective-timeout.

A rank that stops (SIGSTOP, a dead GPU, a filesystem that hangs, a deadlocked host thread) would leave the
others inside a collective for ever: MPI's blocking calls and NCCL's kernels wait without a deadline. So,
as PyTorch's NCCL watchdog and DeepSpeed's timeouts do:

  mpi   every collective is MPI's non-blocking form (Iallreduce, Ireduce_scatter, Iallgatherv, Ibcast, Ibarrier)
        and `Watch.wait` tests it in a loop with a deadline: spinning for the first 50 us (ranks in step
        finish a small collective in microseconds), then yielding the core between tests as MPICH's own
        blocking wait does (free cores: the yield returns at once; a rank sharing its core with a peer lets
        the peer run), then, past a second, sleeping 1 ms between tests (a peer writing a checkpoint). On
        expiry: one line, then MPI_Abort, which ends every rank.
  nccl  NCCL enqueues a kernel and returns at once; the wait happens on the GPU. A CUDA event is recorded after
        each collective on the comm stream, and a thread on the host (`NcclWatchdog`) queries the oldest one
        against the deadline; on expiry it aborts the communicator (ncclCommAbort: NCCL's kernels give up),
        prints the line and ends the job. A collective captured into a CUDA graph is a node of the graph, not
        something the host can query, so the thread watches each replay of the graph as one operation (an
        event after the launch). Recording an event is not a synchronisation: the step waits for nothing.

Which rank did not arrive. Every collective has a sequence number (#1, #2, ...), the same on every rank since
the ranks make the same calls in the same order. Each rank publishes on a small board, one-sided MPI memory
(MPI_Win_allocate; MPICH maps it as shared memory between the ranks of a host), the number of the last
collective it entered, the last it finished, its step and the operation. Reading a board (MPI_Rget) needs
nothing from its owner, so a SIGSTOPped rank's board still answers; a board that does not answer within a
second (another host's rank that is not driving MPI) is reported as such. The rank whose deadline passes
reads every board, writes an alarm into every other board, prints its line, waits a second for the others
to print theirs (each rank waiting in a collective checks its own board's alarm, and reads the boards
likewise), and calls MPI_Abort. A rank of this host that died (killed, crashed) is seen at once: a rank
waiting for it checks every 10 ms that its peers on this host still run (the launcher ends the job a few
tenths of a second later; a dead rank elsewhere can only be seen by that launcher).

The default timeout, DEFAULT_TIMEOUT_S, is PyTorch's NCCL default (10 minutes). It must exceed the longest
legitimate wait of one rank for another, which is not the length of any step (every rank does the same
work) but the work that one rank does alone while the others wait at the next collective: rank 0 writing
the model file of a checkpoint or --save, a sample printed during training (--sample-every), and at start
the ranks' unequal start-up (imports, JIT compilation, CUDA graph capture). BENCHMARKS.md lists the
measured waits; the largest is seconds, a factor of 10 and more below the default.
"""
from __future__ import annotations

import collections
import faulthandler
import math
import os
import pickle
import sys
import threading
import time

import numpy as np

from .lock import process_state

DEFAULT_TIMEOUT_S = 600.0     # PyTorch's default for NCCL (torch.distributed, 10 minutes)
TIMEOUT_EXIT = 124            # exit status of a job ended by the watchdog (as timeout(1) reports a timeout)
PEER_DIED_EXIT = 1
SPIN_S = 1e-3                 # spin on MPI_Test this long (ranks in step finish a collective in microseconds),
YIELD_S = 1.0                 # then yield the core between tests (as MPICH's own blocking wait does) this long,
                              # then sleep 1 ms between tests
CHECK_S = 0.01                # how often a waiting rank checks the deadline, its alarm and its peers
ASK_S = 1.0                   # how long a rank waits for the other ranks' boards at expiry
GRACE_S = 1.0                 # after its line, how long a rank lets the others print theirs before MPI_Abort
LAST_RESORT_S = 8.0           # after its line, the process exits (status 1) whatever hangs: see Watch.end
POLL_S = 0.05                 # how often the NCCL watchdog thread queries its events

SURVEY_S = 0.3                # at expiry, the boards are read twice this far apart: who is still waiting
# the board: one row of int64 per rank. BEAT counts up while the rank waits in a collective (every check) or
# ends the job: a rank whose count stands still is not waiting (stopped, hung, busy elsewhere)
POSTED, DONE, STEP, OP, ALARM, BEAT = range(6)
SLOTS = 6
# operation codes on the board (a rank's own line names its operation in full)
OPS = ("start-up", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "gather", "CUDA graph")


def peek_timeout(argv) -> float | None:
    """--collective-timeout S from a command line before it is parsed (the start-up's own collectives run
    before the flags are checked, under this deadline). None if absent or not a positive finite number (the
    check of the flags then refuses it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--collective-timeout=") else \
            argv[i + 1] if a == "--collective-timeout" and i + 1 < len(argv) else None
        if value is not None:
            try:
                t = float(value)
            except ValueError:
                return None
            return t if math.isfinite(t) and t > 0 else None
    return None


class Watch:
    """This process's side of the watchdog: the deadline, the sequence numbers, and (with several ranks)
    the board. `Watch()` alone (one process) only counts. The training loop sets `step`."""

    def __init__(self, world=None, timeout: float | None = None):
        self.timeout = timeout or DEFAULT_TIMEOUT_S
        self.seq = 0                  # collectives this rank has entered
        self.step: int | None = None  # the training step, for the lines (None: before the first)
        self.world = world
        self.rank, self.size = (world.Get_rank(), world.Get_size()) if world is not None else (0, 1)
        self.ending = threading.Lock()          # one line per process, whichever thread sees it first
        self.win = None
        # this rank's row, as a memoryview of int64 (a store costs ~30 ns, a NumPy one ~100): in the MPI
        # window once there is one
        self.board = memoryview(bytearray(8 * SLOTS)).cast("q")
        self.hosts: list[str] = [""]
        self.neighbours: list[tuple[int, int, int | None]] = []     # (rank, pid, start tick) on this host
        if world is None or self.size == 1:
            return
        from mpi4py import MPI
        self.MPI = MPI
        # who runs where (host, pid, start tick): the ranks of this host are checked for life while waiting
        me = (MPI.Get_processor_name(), os.getpid(), process_state(os.getpid())[1])
        self.peers = self.allgather_object(me)
        self.hosts = [h for h, _, _ in self.peers]
        self.neighbours = [(r, pid, tick) for r, (h, pid, tick) in enumerate(self.peers)
                           if h == me[0] and r != self.rank]
        # every rank has arrived above, so this (blocking) collective completes
        self.win = MPI.Win.Allocate(SLOTS * 8, 8, comm=world)
        board = memoryview(self.win.tomemory()).cast("B").cast("q")
        board[:] = self.board
        self.board = board
        self.win.Lock_all(MPI.MODE_NOCHECK)     # one passive-target epoch for the whole run: Rget at any time

    # ---- the board --------------------------------------------------------------------------------------
    def begin(self, op: str) -> int:
        """This rank enters collective `op`: its number, published."""
        self.seq += 1
        b = self.board
        b[POSTED], b[STEP], b[OP] = self.seq, -1 if self.step is None else self.step, OP_CODES.get(op) or _op_code(op)
        return self.seq

    def finished(self, seq: int) -> None:
        self.board[DONE] = seq

    # ---- MPI: a non-blocking collective waited on with a deadline -----------------------------------------
    def wait(self, op: str, request) -> None:
        """Wait for the MPI request of collective `op` (just posted), within the deadline."""
        seq = self.begin(op)
        if not request.Test():
            t0 = time.monotonic()
            check = t0 + CHECK_S
            while not request.Test():
                now = time.monotonic()
                if now >= check:
                    check = now + CHECK_S
                    self.check(op, seq, self.step, t0, now)
                if now - t0 > YIELD_S:
                    time.sleep(0.001)
                elif now - t0 > SPIN_S:
                    os.sched_yield()
        self.finished(seq)

    def check(self, op: str, seq: int, step, t0: float, now: float, on_expiry=None) -> None:
        """While waiting in collective #seq since t0: end the job if its deadline passed, another rank's
        watchdog raised the alarm, or a rank of this host died."""
        self.board[BEAT] += 1
        if self.size == 1:
            if now - t0 > self.timeout:
                self.expire(op, seq, step, t0, on_expiry)
            return
        if now - t0 > self.timeout or self.board[ALARM]:
            self.expire(op, seq, step, t0, on_expiry)
        for r, pid, tick in self.neighbours:
            state, started = process_state(pid)
            if state in (None, "Z", "X") or (tick is not None and started != tick):
                self.peer_died(r, pid, op, seq, step, on_expiry)

    def allgather_object(self, obj, op: str = "gather") -> list:
        """Every rank's (picklable) obj, by rank, through two watched collectives: the sizes, then the bytes."""
        if self.world is None or self.size == 1:
            return [obj]
        MPI = self.MPI
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self.wait(op, self.world.Iallgather(np.array([data.size], np.int64), sizes))
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), np.uint8)
        self.wait(op, self.world.Iallgatherv(data, [out, (sizes, displs), MPI.BYTE]))
        return [pickle.loads(out[d:d + n].tobytes()) for d, n in zip(displs, sizes)]

    # ---- expiry ------------------------------------------------------------------------------------------
    def boards(self, ranks=None, within: float = ASK_S) -> dict[int, np.ndarray | None]:
        """The boards of `ranks` (default: every other rank), read one-sided (None: no answer in time)."""
        MPI = self.MPI
        got = {r: np.zeros(SLOTS, np.int64) for r in (ranks or range(self.size)) if r != self.rank}
        reqs = {r: self.win.Rget(buf, r, (0, SLOTS, MPI.INT64_T)) for r, buf in got.items()}
        until = time.monotonic() + within
        while reqs and time.monotonic() < until:
            for r in [r for r, q in reqs.items() if q.Test()]:
                del reqs[r]
            time.sleep(0.001)
        for r in reqs:
            got[r] = None
        return got

    def alarm_others(self) -> None:
        """Write `rank + 1` into every other board's alarm: each rank waiting in a collective ends too."""
        me = np.array([self.rank + 1], np.int64)
        reqs = [self.win.Rput(me, r, (ALARM, 1, self.MPI.INT64_T)) for r in range(self.size) if r != self.rank]
        until = time.monotonic() + 0.5
        while not all(q.Test() for q in reqs) and time.monotonic() < until:
            time.sleep(0.001)

    def expire(self, op: str, seq: int, step, t0: float, on_expiry=None) -> None:
        """Collective #seq has not completed: one line naming it and the ranks that did not arrive, then the
        end of the job (on_expiry first: NCCL's abort)."""
        self.ending.acquire()                   # another thread already ends this process: wait for it
        waited = time.monotonic() - t0
        alarm = int(self.board[ALARM]) - 1
        if self.size == 1:
            why = "the GPU never finished it"
        elif self.win is None:
            why = "the ranks that did not arrive cannot be told yet (MPI's start-up)"
        else:
            why = self.missing(seq, self.survey())
            if alarm < 0:
                self.alarm_others()
        cause = (f"waited {waited:.0f} s when rank {alarm}'s watchdog ended the job" if alarm >= 0 else
                 f"did not complete within --collective-timeout {self.timeout:g} s")
        self.end(f"error: collective watchdog: {op} #{seq} {_at(step)} {cause}: {why}", TIMEOUT_EXIT, on_expiry)

    def pause(self, seconds: float) -> None:
        """Sleep, beating: a rank that ends the job still counts as waiting, not as the one that stopped."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            self.board[BEAT] += 1
            time.sleep(CHECK_S)

    def survey(self) -> dict:
        """The other ranks at expiry: rank -> (its board, whether it beats: waits in a collective too), read
        twice SURVEY_S apart; None for a board that does not answer."""
        first = self.boards()
        self.pause(SURVEY_S)
        second = self.boards([r for r, b in first.items() if b is not None], within=ASK_S)
        return {r: None if b is None or second.get(r) is None else (second[r], second[r][BEAT] != b[BEAT])
                for r, b in first.items()}

    def missing(self, seq: int, survey: dict) -> str:
        """The ranks that hold collective #seq up: not waiting in a collective (their beat stands still) and
        not past it; with where each stopped and, on this host, what its process is doing."""
        late = []
        for r, got in survey.items():
            if got is None:
                late.append(f"rank {r} (its board does not answer)")
                continue
            b, beating = got
            if beating or b[DONE] >= seq:
                continue
            what = [f"it stopped {_where(b, seq)}"]
            pid = next((pid for q, pid, _ in self.neighbours if q == r), None)
            state = process_state(pid)[0] if pid else None
            if state in STATES:
                what.append(f"its process, pid {pid}, {STATES[state]}")
            late.append(f"rank {r} ({'; '.join(what)})")
        if not late:
            return "every other rank waits in a collective too (a network or MPI failure?)"
        return f"{', '.join(late)} did not arrive"

    def peer_died(self, r: int, pid: int, op: str, seq: int, step, on_expiry=None) -> None:
        self.ending.acquire()
        # its board, quickly: the launcher is ending the job already
        b = self.boards([r], within=0.02).get(r) if self.win is not None else None
        last = f" {_where(b, seq)}" if b is not None else ""
        self.end(f"error: rank {r} (pid {pid} on {self.hosts[r]}) died{last}; this rank waits for it in {op} "
                 f"#{seq} {_at(step)}", PEER_DIED_EXIT, on_expiry)

    def end(self, line: str, code: int, on_expiry=None) -> None:
        """Print the line, end this rank's communicator (on_expiry), let the others print, end the job."""
        say_line((f"rank {self.rank}: " if self.size > 1 else "") + line)
        sys.stdout.flush()
        # what follows may block for good (CuPy's ncclCommAbort holds the GIL, and NCCL's abort can wait on
        # the device): faulthandler's thread, which needs no GIL, ends the process LAST_RESORT_S later if so
        self.quiet = open(os.devnull, "w")      # noqa: SIM115  (kept open until the process ends)
        faulthandler.dump_traceback_later(LAST_RESORT_S, exit=True, file=self.quiet)
        if on_expiry is not None:
            on_expiry()
        if self.size > 1:
            self.pause(GRACE_S)
            abort_job(self.world, code)
        os._exit(code)

    def close(self) -> None:
        """At exit, before MPI_Finalize (every rank, like any collective): free the board once every rank is
        here (a watched barrier first, as MPI_Win_free waits without a deadline)."""
        if self.win is not None:
            self.wait("barrier", self.world.Ibarrier())
            win, self.win = self.win, None
            win.Unlock_all()
            win.Free()


def say_line(line: str) -> None:
    """One line on stderr in one write: the launcher forwards every rank's stderr into one stream, and a line
    that print() wrote as two pieces (the text, then the newline) can come out with another rank's line
    between them."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode("utf-8", "replace"))


def abort_job(world, code: int) -> None:
    """MPI_Abort: the launcher ends every rank (a stopped one too). This rank has said why in its own line;
    MPICH's "application called MPI_Abort" would only repeat it, so stderr goes quiet first."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    world.Abort(code)


# what a process state in /proc/PID/stat says about a rank that did not arrive
STATES = {"T": "is stopped: SIGSTOP, or a debugger", "t": "is stopped by a debugger",
          "D": "waits in the kernel (a filesystem or device that does not answer?)", "Z": "has died",
          "X": "has died"}


OP_CODES = {op: i for i, op in enumerate(OPS)}


def _op_code(op: str) -> int:
    name = op.split(" (")[0]
    return OPS.index(name) if name in OPS else OPS.index("CUDA graph") if name.startswith("CUDA graph") else 0


def _at(step) -> str:
    return "before the first step" if step is None else f"at step {step}"


def _where(board, seq: int) -> str:
    """Where a rank's board says it is, seen from collective #seq: "inside it", "inside all_gather #7 at step
    2" (entered, not finished), or "after all_gather #7 at step 2" (its last, finished)."""
    if board[POSTED] >= seq and board[DONE] < seq:
        return "inside it"
    op = OPS[board[OP]] if 0 <= board[OP] < len(OPS) else "?"
    return (f"{'after' if board[DONE] >= board[POSTED] else 'inside'} {op} #{board[POSTED]} "
            f"{_at(None if board[STEP] < 0 else int(board[STEP]))}")


class NcclWatchdog:
    """The host thread that bounds NCCL's collectives (PyTorch's watchdog): `after(stream, op)`, called right
    after a collective (or a CUDA graph replay) is enqueued on `stream`, records an event there; the thread
    queries the oldest event every POLL_S and, past the deadline, aborts the communicator (`abort`) and
    ends the job with one line. Events are reused once complete: recording costs microseconds."""

    def __init__(self, watch: Watch, gpu_index: int, abort):
        self.watch, self.gpu_index, self.abort = watch, gpu_index, abort
        self.pending: collections.deque = collections.deque()   # (seq, op, step, event, t0), oldest first
        self.free: list = []
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="llmz-nccl-watchdog", daemon=True)
        self.thread.start()

    def after(self, stream, op: str) -> None:
        import cupy
        seq = self.watch.begin(op)
        event = self.free.pop() if self.free else cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        self.pending.append((seq, op, self.watch.step, event, time.monotonic()))

    def _run(self) -> None:
        import cupy
        cupy.cuda.Device(self.gpu_index).use()
        while not self.stopped:
            time.sleep(POLL_S)
            try:
                while self.pending and self.pending[0][3].done:
                    seq, _, _, event, _ = self.pending.popleft()
                    self.watch.finished(seq)
                    self.free.append(event)
            except cupy.cuda.runtime.CUDARuntimeError as e:     # the GPU failed: say so, end the job
                seq, op, step, _, _ = self.pending[0]
                self.watch.ending.acquire()
                self.watch.end(f"error: CUDA error while waiting for {op} #{seq} {_at(step)}: {e}", 1)
            if self.pending and not self.stopped:
                seq, op, step, _, t0 = self.pending[0]
                self.watch.check(op, seq, step, t0, time.monotonic(), self.abort)

    def stop(self) -> None:
        self.stopped = True
