"""Who am I among the ranks, and how a failing rank takes the others down with it.

llm.c style: `mpiexec -n N python -m llmz.train` starts N processes; MPI tells each its rank and the world
size; the local rank (this rank's index among the ranks on the same host, found by gathering hostnames)
picks the GPU. A single process started without mpiexec is rank 0 of 1.

A rank that dies while the others wait in a collective would leave them hung forever, so every entry point
runs its main under `abort_on_error`: the failing rank prints one line and calls MPI_Abort, and the
launcher kills the rest. The start-up (the check of the flags, the locks) runs after the ranks are up,
under `agree`: every rank checks, the outcome is gathered, and a refusal anywhere ends every rank with one
line from rank 0 and the same exit status, no abort needed.

Every collective between ranks, the start-up's too, has a deadline (llmz.run.watchdog): a rank that stops
is named by the others, not waited for. SIGTERM and SIGHUP end a run as Ctrl-C does: one line, saying where.

Before the ranks meet. MPI's start-up (MPI_Init) waits for every rank, and until it completes no collective,
no MPI_Abort, can tell one rank about another. So:
  - what must be known before MPI starts (the file-size limit MPI's shared memory needs, mpi4py's MPI
    library) is checked by each rank for itself, and a rank that cannot start says so in its own line
    (`rank R: error: ...`; once, without the rank, where every rank of the job fails alike) and ends the job
    itself (`cannot_start`): under MPICH's Hydra through the launcher's PMI socket ("cmd=abort", what
    MPI_Abort sends), under Open MPI by its non-zero exit, which makes mpirun end the job;
  - MPI_Init runs under the collective deadline (llmz.run.watchdog.StartupWatch): a rank of this host that ends
    before the ranks met is named at once, one that stops (or hangs) before or inside MPI_Init once it has
    made no progress for --collective-timeout; ranks on other hosts cannot be seen before MPI is up, and are
    named as such at the deadline;
  - everything else (the flags, the files they name, the locks) waits until the ranks have met: `agree`.

Importing this module is cheap: mpi4py is imported inside `init_ranks` only, which checks what MPI's start-up
needs before it starts MPI (MPI_Init_thread).
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import NoReturn

from llmz.errors import INTERRUPTED_EXIT, AgreedError, LlmzError
from llmz.run.environment import lone_rank_line
from llmz.run.threads import share_cores
from llmz.run.watchdog import StartupWatch, Watch, abort_job, pmi_abort, say_line

ABORT_GRACE_S = 0.5          # seconds between printing the error line and MPI_Abort
# set by launchers that start several ranks: a rank that sees one of these must not run alone
_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
# the ranks the launcher starts on this host (MPICH's Hydra, Open MPI)
_LAUNCHER_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
# MPI's start-up writes shared-memory files (MPICH over UCX: 4.1 MiB each, measured); under a smaller
# file-size limit (ulimit -f) it dies with a stack of MPI and UCX errors, so llmz refuses first, in one line
MPI_MIN_FILE_SIZE = 16 << 20


@dataclass(frozen=True)
class RankInfo:
    rank: int           # 0 .. world_size-1
    world_size: int
    local_rank: int     # index of this rank among the ranks on the same host; also its GPU index
    local_size: int     # ranks on this host
    hostname: str
    watch: Watch = field(default_factory=Watch, compare=False, repr=False)   # the collectives' deadline

    @property
    def gpu_index(self) -> int:
        return self.local_rank

    def allgather(self, obj) -> list:
        """Every rank's obj (picklable), by rank, on every rank; under the collective watchdog. (A method, so
        that the model's side, llmz.data's check of the ranks' files, gathers without importing llmz.run.)"""
        if self.world_size == 1:
            return [obj]
        if self.watch.world is not None:
            return self.watch.allgather_object(obj)
        from mpi4py import MPI
        return MPI.COMM_WORLD.allgather(obj)


def _launcher_says(names: tuple[str, ...], default: int | None, env=os.environ) -> int | None:
    """The number in the first of the launcher's variables `names` that an environment (this process's, or
    another's: _environ) sets."""
    return next((int(env[v]) for v in names if env.get(v, "").isdecimal()), default)


def _launcher_world_size() -> int:
    return _launcher_says(_LAUNCHER_SIZE_VARS, 1)


def _launcher_rank() -> int:
    """This process's rank as the launcher set it in the environment (before MPI is up); 0 without one."""
    return _launcher_says(_LAUNCHER_RANK_VARS, 0)


def _launcher_local_size() -> int | None:
    """How many ranks the launcher starts on this host (None: it does not say)."""
    return _launcher_says(_LAUNCHER_LOCAL_SIZE_VARS, None)


def file_size_limit(pid: int | None = None) -> int | None:
    """The soft limit on the size of a file this process (or process `pid` of this host, from
    /proc/PID/limits) writes (ulimit -f), in bytes; None: unlimited, or not known."""
    if pid is None:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        return None if soft == resource.RLIM_INFINITY else soft
    try:
        with open(f"/proc/{pid}/limits") as f:
            soft = next(line for line in f if line.startswith("Max file size")).split()[3]
    except (OSError, StopIteration, IndexError):
        return None
    return int(soft) if soft.isdigit() else None


def _mpi_too_small(limit: int | None) -> bool:
    return limit is not None and limit < MPI_MIN_FILE_SIZE


def init_ranks(collective_timeout: float | None = None) -> RankInfo:
    """Rank, world size and local rank from MPI; rank 0 of 1 when mpi4py is missing and no launcher ran us.
    collective_timeout: the deadline of the start-up's collectives (llmz.run.watchdog; None: its default)."""
    n = _launcher_world_size()
    limit = file_size_limit()
    if _mpi_too_small(limit):
        if n > 1:
            from ..config import fmt_bytes
            cannot_start(LlmzError(f"the file-size limit (ulimit -f) is {fmt_bytes(limit)}: MPI's start-up "
                                   f"writes shared-memory files of several MiB and dies under it; raise it (ulimit "
                                   f"-f unlimited, or at least {MPI_MIN_FILE_SIZE >> 20} MiB)"),
                         alike=lambda pid: _mpi_too_small(file_size_limit(pid)))
        share_cores(1)
        return RankInfo(0, 1, 0, 1, socket.gethostname(), Watch(timeout=collective_timeout))  # no MPI needed
    try:
        import mpi4py
        mpi4py.rc.initialize = False        # MPI_Init_thread below, once the limit above is known to be fine
        mpi4py.rc.finalize = True
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001  (mpi4py absent, or its MPI library fails to load)
        if n > 1:
            cannot_start(LlmzError(f"started as one of {n} ranks but mpi4py cannot load MPI ({_first_line(e)}); "
                                   "install llmz[mpi]"),
                         alike=_same_python)
        share_cores(1)
        return RankInfo(0, 1, 0, 1, socket.gethostname(), Watch(timeout=collective_timeout))
    local = {}
    if not MPI.Is_initialized():
        if n > 1:                           # MPI_Init under the deadline, watching this host's other ranks
            local = local_ranks()
            StartupWatch(collective_timeout, _launcher_rank(), n, local, _launcher_local_size(), local_ranks).run(
                lambda: init_thread(MPI))
        else:
            MPI.Init_thread(MPI.THREAD_MULTIPLE)    # the NCCL watchdog thread reads the boards too
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    hostname = MPI.Get_processor_name()
    if size == 1:
        if _launcher_world_size() > 1:              # another MPI's mpiexec: each rank alone in its world
            raise LlmzError(lone_rank_line(_launcher_world_size(), MPI.Get_library_version()))
        share_cores(1)
        return RankInfo(0, 1, 0, 1, hostname, Watch(timeout=collective_timeout))
    watch = Watch(world, collective_timeout, local)  # gathers every rank's host: a collective
    atexit.register(watch.close)                    # before MPI_Finalize (registered when MPI started)
    # local rank: how many ranks before me share my host (llm.c gathers hostname hashes the same way)
    hosts = watch.hosts
    local_rank = sum(1 for h in hosts[:rank] if h == hostname)
    local_size = sum(1 for h in hosts if h == hostname)
    share_cores(local_size)             # one BLAS pool per rank, sized to the cores this host's ranks share
    return RankInfo(rank, size, local_rank, local_size, hostname, watch)


def init_thread(MPI) -> None:
    """MPI_Init_thread(THREAD_MULTIPLE) (the NCCL watchdog thread reads the boards too), called through ctypes,
    which lets go of the GIL while it waits (mpi4py's MPI.Init_thread holds it): the start-up watchdog's
    thread runs meanwhile. mpi4py finds MPI initialised and goes on as if it had done it (rc.finalize: it
    finalises at exit). Where the symbol cannot be found, mpi4py's call (no deadline then)."""
    import ctypes
    try:
        fn = ctypes.CDLL(MPI.__file__).MPI_Init_thread     # the extension's handle reaches its libmpi
    except (OSError, AttributeError):
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    provided = ctypes.c_int(-1)
    code = fn(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.byref(provided))
    if code != 0 or not MPI.Is_initialized():
        raise LlmzError(f"MPI_Init_thread failed (error {code})")


# ---- this host's ranks, from /proc, before MPI is up ------------------------------------------------------------
def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process of this host (Linux /proc; {} elsewhere)."""
    parent = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return parent
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return parent


def _environ(pid: int) -> dict[str, str]:
    """Process pid's environment ({} where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(os.fsdecode(e).split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return {}


def _rank_in(env: dict) -> int | None:
    """The launcher's rank in a process's environment (None: not a rank)."""
    return _launcher_says(_LAUNCHER_RANK_VARS, None, env)


def rank_pids(launcher_pid: int, parent: dict[int, int] | None = None) -> dict[int, int]:
    """{rank: pid} of the ranks a launcher (mpiexec, started as launcher_pid) runs on this host, Linux: the
    Python processes under it whose environment holds the launcher's PMI_RANK or OMPI_COMM_WORLD_RANK (a
    process a rank started, which inherits its rank, is not one). For tests and tools that stop or kill one
    rank of a job, and for a rank to see the others of its host before MPI is up (local_ranks)."""
    parent = _parents() if parent is None else parent

    def under_launcher(pid: int) -> bool:
        while pid in parent and pid != launcher_pid:
            pid = parent[pid]
        return pid == launcher_pid

    found = {}
    for pid in parent:
        if pid == launcher_pid or not under_launcher(pid):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                python = os.path.basename(f.read().split(b"\0")[0]).startswith(b"python")
        except OSError:
            continue
        rank = _rank_in(_environ(pid)) if python else None
        if rank is not None:
            found[pid] = rank
    return {rank: pid for pid, rank in found.items() if found.get(parent.get(pid)) != rank}


def _launcher_pid(parent: dict[int, int] | None = None) -> int | None:
    """The launcher's process on this host (the nearest ancestor that is not a rank itself: Hydra's
    hydra_pmi_proxy, Open MPI's prted, orted or mpirun), or None where /proc cannot say."""
    parent = _parents() if parent is None else parent
    launcher = parent.get(os.getpid())
    while launcher is not None and launcher > 1 and _rank_in(_environ(launcher)) is not None:
        launcher = parent.get(launcher)             # a wrapper (bash -c ...) that is a rank too
    return launcher if launcher is not None and launcher > 1 else None


def local_ranks() -> dict[int, int]:
    """{rank: pid} of this job's ranks on this host, this one included, before MPI is up: the ranks under the
    launcher's process here (_launcher_pid), of this job's size. Only this rank where /proc cannot say."""
    me, rank, size = os.getpid(), _launcher_rank(), _launcher_world_size()
    parent = _parents()
    launcher = _launcher_pid(parent)
    if launcher is None:
        return {rank: me}
    ranks = {r: pid for r, pid in rank_pids(launcher, parent).items() if _size_in(pid) == size}
    ranks[rank] = me
    return ranks


def _size_in(pid: int) -> int | None:
    return _launcher_says(_LAUNCHER_SIZE_VARS, None, _environ(pid))


def _same_python(pid: int) -> bool:
    """Does process `pid` run the Python this one runs (so that what fails here fails there alike)?"""
    try:
        return os.readlink(f"/proc/{pid}/exe") == os.readlink("/proc/self/exe")
    except OSError:
        return False


# ---- a rank that cannot start MPI ------------------------------------------------------------------------------
def cannot_start(e: LlmzError, alike) -> NoReturn:
    """This rank cannot start MPI (e says why), and the others wait for it inside MPI_Init, where nothing can
    tell them: it says why in its own line, `rank R: error: ...`, and ends the job itself (pmi_abort; under
    Open MPI its non-zero exit does). Where every rank of the job runs on this host and fails alike (alike(pid)
    holds for every other rank still running: its file-size limit, its Python; one no longer running failed
    before this one looked, at the same first check), no rank waits: rank 0 says it once, without its rank,
    and every rank exits. Exit status 2 (a refusal at start); never returns."""
    rank, size = _launcher_rank(), _launcher_world_size()
    if _launcher_local_size() == size and all(alike(pid) for pid in local_ranks().values()):
        if rank == 0:
            say_line(f"error: {e}")
        else:                               # Open MPI ends the job at the first non-zero exit: let it be said
            time.sleep(ABORT_GRACE_S)
        raise SystemExit(2)
    say_line(f"rank {rank}: error: {e}")
    time.sleep(ABORT_GRACE_S)               # the launcher forwards the line; another rank failing says its own
    pmi_abort(2)
    raise SystemExit(2)


def start_failed(e: LlmzError) -> int:
    """init_ranks refused to start once MPI was up in a world of one rank (the mpiexec of another MPI: every
    rank is alone, and fails alike): the line once, from the launcher's rank 0; status 2 on every rank. (A
    rank that cannot start MPI at all says so itself: cannot_start.)"""
    if _launcher_rank() == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
    return 2


def _mpi_rank_and_size() -> tuple[int, int]:
    """Rank and world size if MPI is already running in this process, without starting it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return _launcher_rank(), 1
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()


def agree(ranks: RankInfo, fn, same=None):
    """Run fn() on every rank (the start-up check of the flags, the files they name, the locks) and agree
    on the outcome: if it failed on any rank, every rank raises AgreedError with the first failing rank's
    line ("rank R: ..." when not every rank failed alike). Returns fn()'s result. Ranks other than 0 print
    nothing while fn runs (--help). same(result): a flat dict that must be equal on every rank (the flags:
    ranks that disagree on the model would otherwise fail deep inside MPI); where it differs, every rank
    raises AgreedError naming the first differing key."""
    result, err = None, None
    quiet = ranks.rank != 0 and ranks.world_size > 1
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            result = fn()
    except LlmzError as e:
        err = (_first_line(e), e.exit_code)
    except Exception as e:  # noqa: BLE001  (a bug in a check: still one line on every rank, no hang)
        if os.environ.get("LLMZ_DEBUG") == "1":
            traceback.print_exc()
        err = (f"{type(e).__name__}: {_first_line(e)}", 1)
    errs = ranks.allgather(err)
    failed = [(r, e) for r, e in enumerate(errs) if e is not None]
    if failed:
        r, (msg, code) = failed[0]
        alike = len(failed) == len(errs) and all(e == failed[0][1] for _, e in failed)
        raise AgreedError(msg if alike or ranks.world_size == 1 else f"rank {r}: {msg}", code)
    if same is not None and ranks.world_size > 1:
        views = ranks.allgather(same(result))
        for r, view in enumerate(views):
            for key in view:
                if view[key] != views[0][key]:
                    raise AgreedError(f"the ranks disagree: rank {r} has {key} {view[key]!r}, rank 0 "
                                      f"{key} {views[0].get(key)!r}; every rank must get the same flags", 2)
    return result


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    return lines[0] + (" (... LLMZ_DEBUG=1 shows the rest)" if len(lines) > 1 else "")


def _die(rank: int, world_size: int, line: str | None, code: int, delay: float = 0.0) -> None:
    """Print the error line (once, from the failing rank) and end this rank; with peers, end them too.
    delay: wait that long before printing (a peer interrupted with rank 0 lets rank 0 speak for the job)."""
    if delay and world_size > 1:
        time.sleep(delay)
    if line is not None:
        say_line((f"rank {rank}: " if world_size > 1 else "") + line)
    sys.stdout.flush()
    if world_size > 1:
        # MPI_Abort: the launcher kills every rank, so none waits forever in a collective. The launcher
        # forwards our stderr through a pipe and drops what it has not forwarded when it kills the job: give
        # it a moment.
        time.sleep(ABORT_GRACE_S)
        abort_job(sys.modules["mpi4py.MPI"].COMM_WORLD, code)
    sys.exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, taken as Ctrl-C is (train: "terminated by SIGTERM at step N; last checkpoint ..."),
    with exit status 128 + the signal's number, as shells report a process the signal ended."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"terminated by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


def interrupted(e: KeyboardInterrupt, where: str) -> KeyboardInterrupt:
    """The same interruption (Ctrl-C or a Terminated), its line saying where it found the run."""
    if isinstance(e, Terminated):
        return Terminated(e.signum, f"terminated by {signal.Signals(e.signum).name} {where}")
    return KeyboardInterrupt(f"interrupted {where}")


def _terminate_as_interrupt() -> None:
    """SIGTERM and SIGHUP raise Terminated in the main thread, as SIGINT raises KeyboardInterrupt. A signal
    that is ignored (nohup ignores SIGHUP, so a run survives the end of its terminal) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        raise Terminated(signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, handler)


@contextlib.contextmanager
def abort_on_error(ranks: RankInfo | None = None):
    """Run a rank's main; any exception ends the whole job with one line `rank R: error: <message>`.

    LlmzError prints its message alone, other exceptions `Type: message`; LLMZ_DEBUG=1 adds the traceback.
    An AgreedError (every rank failed alike at start) is printed by rank 0 alone, and every rank exits.
    Ctrl-C (KeyboardInterrupt) prints one line, the KeyboardInterrupt's message if the command gave it one
    (llmz.train: "interrupted at step N; last checkpoint ...") or "interrupted", and exits with 130, as
    shells do for SIGINT; SIGTERM and SIGHUP likewise (Terminated), with 143 and 129.
    A non-zero sys.exit on one rank also aborts the others (they could be waiting for it), silently:
    whoever called sys.exit has said why.
    """
    _terminate_as_interrupt()
    try:
        yield
    except SystemExit as e:
        rank, size = (ranks.rank, ranks.world_size) if ranks else _mpi_rank_and_size()
        if e.code in (None, 0) or size == 1:
            raise
        if isinstance(e.code, int):
            _die(rank, size, None, e.code)
        _die(rank, size, f"error: {e.code}", 1)          # sys.exit("message")
    except AgreedError as e:
        rank = ranks.rank if ranks else _mpi_rank_and_size()[0]
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        rank, size = (ranks.rank, ranks.world_size) if ranks else _mpi_rank_and_size()
        line = str(e) or "interrupted"
        _die(rank, size, line, getattr(e, "exit_code", INTERRUPTED_EXIT), delay=2 * ABORT_GRACE_S if rank else 0.0)
    except BaseException as e:  # noqa: BLE001  (no peer may be left waiting)
        rank, size = (ranks.rank, ranks.world_size) if ranks else _mpi_rank_and_size()
        if os.environ.get("LLMZ_DEBUG") == "1":
            traceback.print_exc()
        msg = _first_line(e)
        if not isinstance(e, LlmzError):
            msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
        if isinstance(e, MemoryError):
            msg += " (out of host memory)"
        _die(rank, size, f"error: {msg}", getattr(e, "exit_code", 1) if isinstance(e, LlmzError) else 1)
