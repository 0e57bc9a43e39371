"""A collective that never returns (llmz.run.watchdog): a stopped rank is named by the others, who end the job
within --collective-timeout + 10 s, the last complete checkpoint intact; the MPI wait is non-blocking calls
tested against a deadline; on a GPU the NCCL communicator is aborted by a thread on the host.

The bounds are generous on purpose: the 2-core CI machine runs these ranks beside other work, and what is
checked is "ends, one line per surviving rank, naming the stopped rank", never a time to the millisecond."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from llmz.run import watchdog
from llmz.run.launch import rank_pids
from llmz.run.state import latest_checkpoint, load_checkpoint
from llmz.run.watchdog import BEAT, DONE, OP, POSTED, STEP, TIMEOUT_EXIT, Watch, missing, peek_timeout
from mpirun import find_mpiexec, is_open_mpi, mpiexec_version, run_mpi, start_mpi

WORKER = "tests/mpi_comm_worker.py"
TIMEOUT = 3                      # --collective-timeout of these tests
SLACK = 10                       # the job must end within TIMEOUT + SLACK once a rank stops
GPU_TIMEOUT = 20                 # on a GPU the first steps compile kernels: ranks may be seconds apart


def llmz_lines(stderr: str) -> list[str]:
    """The lines llmz's ranks wrote. MPICH's launcher adds none (llmz silences its MPI_Abort line); Open MPI's
    mpirun prints a banner of its own after an MPI_Abort, which is not llmz's to count."""
    lines = stderr.strip().splitlines()
    if is_open_mpi(mpiexec_version(find_mpiexec() or "")):
        lines = [line for line in lines if line.startswith(("rank ", "error:"))]
    return lines


def test_the_timeout_is_read_from_the_command_line_before_the_flags_are_checked():
    assert peek_timeout(["--model", "tiny", "--collective-timeout", "7.5"]) == 7.5
    assert peek_timeout(["--collective-timeout=3"]) == 3.0
    assert peek_timeout(["--steps", "3"]) is None
    for bad in ("0", "-1", "nan", "inf", "x"):      # the flag check refuses these; start-up keeps the default
        assert peek_timeout(["--collective-timeout", bad]) is None


def board(posted: int, done: int, step: int, op: str = "all_reduce") -> np.ndarray:
    b = np.zeros(watchdog.SLOTS, np.int64)
    b[POSTED], b[DONE], b[STEP], b[OP] = posted, done, step, watchdog.OPS.index(op)
    return b


@pytest.fixture
def stopped_process():
    """A process of this host in state T (SIGSTOP), as a frozen rank is."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(p.pid, signal.SIGSTOP)
    while watchdog.process_state(p.pid)[0] != "T":
        time.sleep(0.01)
    yield p.pid
    p.kill()
    p.wait()


def three_ranks(neighbours=()) -> Watch:
    """rank 0's Watch in a world of 3, without MPI (the survey is given, not read)."""
    w = Watch(timeout=TIMEOUT)
    w.rank, w.size, w.hosts = 0, 3, ["here"] * 3
    w.neighbours = list(neighbours)
    return w


def test_the_line_names_the_rank_that_stopped_and_not_those_that_wait(stopped_process):
    w = three_ranks([(2, stopped_process, None)])
    # rank 1 waits in #45 as this rank does (its beat moves); rank 2 finished #44 and stands still
    survey = {1: (board(45, 44, 21), True), 2: (board(44, 44, 20), False)}
    assert missing(45, survey, w.neighbours) == (f"rank 2 (it stopped after all_reduce #44 at step 20; its process, "
                                                 f"pid {stopped_process}, is stopped: SIGSTOP, or a debugger) did not "
                                                 f"arrive")
    # rank 2 entered #45 and stands still inside it; rank 1 has finished #45 and moved on
    survey = {1: (board(46, 45, 21, "barrier"), False), 2: (board(45, 44, 21), False)}
    assert missing(45, survey, w.neighbours).startswith("rank 2 (it stopped inside it;")
    # behind: rank 1 still waits in #44, which rank 2 never finished (stopped inside all_gather #44)
    survey = {1: (board(44, 43, 20), True), 2: (board(44, 43, 20, "all_gather"), False)}
    assert "rank 2 (it stopped inside all_gather #44 at step 20;" in missing(45, survey, w.neighbours)
    assert "rank 1" not in missing(45, survey, w.neighbours)
    assert (missing(45, {1: None, 2: (board(45, 44, 21), True)}, w.neighbours)
            == "rank 1 (its board does not answer) did not arrive")
    waiting = {1: (board(45, 44, 21), True), 2: (board(45, 44, 21), True)}
    assert "every other rank waits" in missing(45, waiting, w.neighbours)


def test_waiting_past_the_deadline_ends_the_job_and_a_dead_neighbour_at_once(monkeypatch):
    ended = []

    def end(line, code, on_expiry=None):
        ended.append((line, code))
        raise SystemExit(code)              # Watch.end never returns
    w = Watch(timeout=TIMEOUT)
    monkeypatch.setattr(w, "end", end)
    seq = w.begin("reduce_scatter")
    w.check("reduce_scatter", seq, 4, t0=100.0, now=100.0 + TIMEOUT / 2)       # within the deadline: nothing
    assert not ended and w.board[BEAT] == 1
    with pytest.raises(SystemExit):
        w.check("reduce_scatter", seq, 4, t0=100.0, now=100.0 + TIMEOUT + 0.01)
    line = (f"error: collective watchdog: reduce_scatter #1 at step 4 did not complete within --collective-timeout "
            f"{TIMEOUT} s: the GPU never finished it")
    assert ended == [(line, TIMEOUT_EXIT)]
    # a rank of this host that has died (a zombie: exited, not yet reaped) is named at the next check
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    while watchdog.process_state(dead.pid)[0] != "Z":
        time.sleep(0.01)
    w = three_ranks([(1, dead.pid, watchdog.process_state(dead.pid)[1])])
    monkeypatch.setattr(w, "end", end)
    seq = w.begin("all_gather")
    with pytest.raises(SystemExit):
        w.check("all_gather", seq, 9, t0=100.0, now=100.1)
    line = f"error: rank 1 (pid {dead.pid} on here) died; this rank waits for it in all_gather #1 at step 9"
    assert ended[-1] == (line, watchdog.PEER_DIED_EXIT)
    dead.wait()


@pytest.mark.mpi
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_frozen_rank_is_named_by_every_other_and_the_job_ends_within_the_timeout(nproc):
    p = run_mpi(nproc, [WORKER, "freeze", "--timeout", str(TIMEOUT)], timeout=120)
    ended = time.time()
    frozen = nproc - 1
    lines = llmz_lines(p.stderr)
    print(p.stdout, p.stderr)
    assert p.returncode == TIMEOUT_EXIT, p.stderr
    assert sorted(line.split(":")[0] for line in lines) == [f"rank {r}" for r in range(frozen)], lines
    for line in lines:
        assert f"all_reduce #45 at step 21 did not complete within --collective-timeout {TIMEOUT} s: rank {frozen} " \
               f"(it stopped after all_reduce #44 at step 20; its process, pid " in line, line
        assert line.endswith("is stopped: SIGSTOP, or a debugger) did not arrive"), line
    froze = float(p.stdout.split("freezing at ")[1].split()[0])
    assert ended - froze < TIMEOUT + SLACK, f"ended {ended - froze:.1f} s after the freeze"


@pytest.mark.mpi
def test_a_rank_frozen_with_a_started_collective_in_flight_is_named_and_the_job_ends_within_the_timeout():
    """ZeRO-2 on CPU ranks leaves reduce-scatters in flight while backward computes: the one the others wait
    for is numbered from when it was started, and the rank that stopped after starting it is "inside it"."""
    p = run_mpi(2, [WORKER, "freeze", "--started", "--timeout", str(TIMEOUT)], timeout=120)
    ended = time.time()
    lines = llmz_lines(p.stderr)
    print(p.stdout, p.stderr)
    assert p.returncode == TIMEOUT_EXIT, p.stderr
    assert len(lines) == 1 and lines[0].startswith("rank 0: error: collective watchdog: reduce_scatter #"), lines
    assert re.search(rf"reduce_scatter #(\d+) at step 2[01] did not complete within --collective-timeout {TIMEOUT} "
                     r"s: rank 1 \(it stopped (inside it|inside reduce_scatter #\d+ at step 20); its process, pid "
                     r"\d+, is stopped: SIGSTOP, or a debugger\) did not arrive$", lines[0]), lines[0]
    froze = float(p.stdout.split("freezing at ")[1].split()[0])
    assert ended - froze < TIMEOUT + SLACK, f"ended {ended - froze:.1f} s after the freeze"


# ---- MPI's start-up: before the ranks meet -----------------------------------------------------------------
def startup_watch(peers: dict, size: int, timeout: float = 1.0):
    """rank 0's StartupWatch in a one-host world of `size` whose other ranks are `peers` ({rank: pid}), its end
    recorded (and the wait it watches released) instead of ending this process."""
    w = watchdog.StartupWatch(timeout, 0, size, {0: os.getpid(), **peers}, size)
    ended = []

    def end(line, code):
        ended.append((line, code, time.monotonic() - w.t0))
        w.done.set()                            # the watch's thread stops at its next look
    w.end = end
    return w, ended


def test_the_start_up_watch_names_a_stopped_rank_at_the_deadline_and_a_dead_one_at_once(stopped_process):
    w, ended = startup_watch({1: stopped_process}, 2)
    w.run(lambda: w.done.wait(30))              # "MPI_Init": returns when the watch ends the job
    line, code, took = ended[0]
    assert line == (f"error: collective watchdog: MPI's start-up (MPI_Init) did not complete within "
                    f"--collective-timeout 1 s: rank 1 (its process, pid {stopped_process}, is stopped: SIGSTOP, or a "
                    f"debugger, before MPI's start-up) did not arrive") and code == TIMEOUT_EXIT
    assert 1.0 < took < 1.0 + 5, took
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    while watchdog.process_state(dead.pid)[0] != "Z":
        time.sleep(0.01)
    w, ended = startup_watch({1: dead.pid}, 2, timeout=60)
    w.run(lambda: w.done.wait(30))
    line, code, took = ended[0]
    host = os.uname().nodename
    assert line == (f"error: rank 1 (pid {dead.pid} on {host}) ended before the ranks met; this rank waited for it "
                    f"in MPI's start-up (MPI_Init)") and code == watchdog.PEER_DIED_EXIT and took < 2, (line, took)
    dead.wait()


def test_the_start_up_watch_waits_for_a_rank_that_is_slow_but_busy_and_lets_a_completed_start_go():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        w, ended = startup_watch({1: busy.pid}, 2, timeout=1.0)
        w.run(lambda: time.sleep(2.5))          # past the deadline, below STARTUP_CAP x it: still importing
        assert ended == []
    finally:
        busy.kill()
        busy.wait()


def start_up_case(rank1: str, *flags: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """mpiexec: rank 0 runs llmz.train, rank 1 runs Python code `rank1` (which may run llmz.train in turn) ->
    (the finished job, seconds it took)."""
    train = ["--device", "cpu", "--model", "tiny", "-b", "2", "-t", "8", "--val-batches", "1", "--sample-tokens",
             "0", "--quiet", "--steps", "2", *flags]
    t0 = time.time()
    p = run_mpi(1, ["-m", "llmz.train", *train, ":", "-n", "1", sys.executable, "-c", rank1, *train], timeout=timeout)
    return p, time.time() - t0


TRAIN = "import sys\nfrom llmz.train import main\nsys.exit(main(sys.argv[1:]))\n"


@pytest.mark.mpi
def test_a_rank_that_cannot_start_mpi_says_why_in_its_own_line_and_ends_the_job():
    limited = "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (51200, 51200))   # ulimit -f 50\n" + TRAIN
    p, took = start_up_case(limited)
    print(f"exit {p.returncode} after {took:.1f} s\n{p.stderr}")
    lines = llmz_lines(p.stderr)
    assert p.returncode == 2 and lines[0] == (
        "rank 1: error: the file-size limit (ulimit -f) is 50.00 KiB: MPI's start-up writes shared-memory files of "
        "several MiB and dies under it; raise it (ulimit -f unlimited, or at least 16 MiB)"), p.stderr
    # MPICH: that line alone (the job ended through the launcher's PMI abort); Open MPI: rank 0 may say it waited
    assert all("rank 1" in line and "ended before the ranks met" in line for line in lines[1:]), lines
    assert took < 60


@pytest.mark.mpi
def test_a_rank_stopped_before_mpi_starts_is_named_by_the_others_at_the_deadline():
    stopped = "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n" + TRAIN
    p, took = start_up_case(stopped, "--collective-timeout", str(TIMEOUT))
    print(f"exit {p.returncode} after {took:.1f} s\n{p.stderr}")
    lines = llmz_lines(p.stderr)
    assert p.returncode == TIMEOUT_EXIT and len(lines) == 1, p.stderr
    assert re.match(rf"^rank 0: error: collective watchdog: MPI's start-up \(MPI_Init\) did not complete within "
                    rf"--collective-timeout {TIMEOUT} s: rank 1 \(its process, pid \d+, is stopped: SIGSTOP, or a "
                    rf"debugger, before MPI's start-up\) did not arrive$", lines[0]), lines[0]
    assert took < 60 + TIMEOUT


@pytest.mark.mpi
def test_a_rank_that_ends_before_the_ranks_meet_is_named_by_the_others_at_once():
    p, took = start_up_case("import sys, time\ntime.sleep(2)\nsys.exit(3)\n")     # no deadline: the default 600 s
    print(f"exit {p.returncode} after {took:.1f} s\n{p.stderr}")
    assert p.returncode != 0 and took < 60, (p.returncode, took)
    if not is_open_mpi(mpiexec_version(find_mpiexec() or "")):      # Open MPI's mpirun ends the job itself
        lines = llmz_lines(p.stderr)
        assert len(lines) == 1 and lines[0].startswith("rank 0: error: rank 1 ") and \
            "ended before the ranks met" in lines[0], p.stderr


# ---- llmz.train itself: the repro ------------------------------------------------------------------
def train_and_freeze(tmp_path, nproc: int, stage: int, device: str = "cpu", timeout: float = TIMEOUT):
    """mpiexec -n nproc llmz.train (--comm mpi) on a small model, checkpointing every 5 steps; once 12 steps are
    logged, SIGSTOP the last rank -> (completed process, seconds from the stop to the end of the job)."""
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    model = ["--model", "tiny", "-b", "4", "-t", "16"] if device == "cpu" else ["--model", "d2", "-b", "4", "-t", "64"]
    args = ["-m", "llmz.train", "--device", device, *model, "--comm", "mpi", "--zero-stage", str(stage),
            "--steps", "100000", "--sample-tokens", "0", "--quiet", "--log", str(log), "--checkpoint-dir", str(ck),
            "--checkpoint-every", "5", "--collective-timeout", str(timeout)]
    proc = start_mpi(nproc, args)
    try:
        t0 = time.time()
        while time.time() - t0 < 180 and proc.poll() is None:
            if log.exists() and sum('"loss"' in line for line in log.read_text().splitlines()) >= 12:
                break
            time.sleep(0.1)
        pids = rank_pids(proc.pid)
        assert len(pids) == nproc, pids
        os.kill(pids[nproc - 1], signal.SIGSTOP)
        stopped = time.time()
        out, err = proc.communicate(timeout=timeout + 120)
        took = time.time() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), took


@pytest.mark.mpi
@pytest.mark.parametrize("nproc, stage, device", [(2, 2, "cpu"), (3, 3, "cpu"),
                                                  pytest.param(2, 2, "gpu", marks=pytest.mark.gpu)])
def test_a_frozen_training_rank_ends_the_job_in_one_line_per_rank_keeping_the_last_checkpoint(tmp_path, nproc, stage,
                                                                                              device):
    """The issue's repro: mpiexec -n N llmz.train --comm mpi, then kill -STOP one rank. On a GPU, two ranks share
    the one GPU over MPI (NCCL refuses two ranks on one GPU)."""
    timeout = TIMEOUT if device == "cpu" else GPU_TIMEOUT
    p, took = train_and_freeze(tmp_path, nproc, stage, device, timeout)
    print(f"{nproc} ranks, stage {stage}, {device}: exit {p.returncode} {took:.1f} s after the SIGSTOP\n{p.stderr}")
    assert p.returncode == TIMEOUT_EXIT and took < timeout + SLACK, (p.returncode, took)
    lines = llmz_lines(p.stderr)
    assert len(lines) == nproc - 1 and all(" did not arrive" in line and f"rank {nproc - 1} (" in line
                                           and "collective watchdog: " in line for line in lines), lines
    step = int(lines[0].split(" at step ")[1].split()[0])
    logged = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert step >= logged[-1], (step, logged[-1])        # the step the job was in when the rank stopped
    ckpt = load_checkpoint(latest_checkpoint(str(tmp_path / "ck")))      # the last DONE checkpoint loads
    assert ckpt.step % 5 == 0 and ckpt.step <= step + 1


# ---- NCCL (skipped without a GPU) -------------------------------------------------------------------------
@pytest.mark.gpu
def test_nccl_watchdog_aborts_a_collective_that_never_runs_and_ends_the_process():
    """One rank with NCCL (so it needs no second GPU): a kernel that never ends holds the comm stream and an
    all-reduce waits behind it; the watchdog thread must print one line, abort the communicator
    (ncclCommAbort) and end the process, while the main thread is blocked in a CUDA synchronisation."""
    t0 = time.time()
    p = subprocess.run([sys.executable, WORKER, "hang", "--device", "gpu", "--comm", "nccl", "--timeout",
                        str(TIMEOUT)], capture_output=True, text=True, timeout=TIMEOUT + 120, check=False,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    took = time.time() - t0
    print(p.stdout, p.stderr, f"{took:.1f} s")
    assert p.returncode == TIMEOUT_EXIT, p.stderr
    # llmz's lines only: Numba may warn on stderr first (a NumbaPerformanceWarning about a small grid, seen on
    # the H200), which is not llmz's to count
    ours = [line for line in p.stderr.splitlines() if line.startswith(("error:", "rank "))]
    assert ours == [f"error: collective watchdog: all_reduce #2 at step 7 did not complete within "
                    f"--collective-timeout {TIMEOUT} s: the GPU never finished it"], p.stderr
    assert "still alive" not in p.stdout and took < TIMEOUT + 60        # + CUDA's and NCCL's start-up


@pytest.mark.gpu
def test_nccl_graphed_steps_are_watched_as_launches_and_every_event_completes(tmp_path):
    """The watchdog records events outside graph capture only: the graphed step still captures, replays,
    and gives the eager step's loss; every watched operation completes."""
    from llmz.run.launch import RankInfo
    from llmz.train import parse_args
    from llmz.trainer import Trainer
    losses = {}
    for graph in (True, False):
        flags = ["--device", "gpu", "--model", "d2", "-b", "4", "-t", "64", "--steps", "4", "--comm", "nccl",
                 "--quiet", "--val-data", ""] + ([] if graph else ["--no-cuda-graph"])
        args, kind = parse_args(flags)
        run = Trainer(args, kind, RankInfo(0, 1, 0, 1, "here"))
        losses[graph] = [run.step(s)["loss"] for s in range(4)]
        run.dev.synchronize()
        time.sleep(3 * watchdog.POLL_S)
        w = run.comm.watch
        assert w.board[DONE] == w.seq and not run.comm.watchdog.pending
        if graph:
            assert set(run.graphs.graphs) == {"micro_step", "update"}
        run.comm.close()
    assert losses[True] == losses[False]
