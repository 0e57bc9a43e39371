"""Re-measure bad inputs and faults against llmz.train, llmz.sample and checkpoint folders.

    python tools/hostile_check.py [-k SUBSTRING] [--timeout S]

The promise under test (README, llmz/args.py): every bad input gives ONE clear `error: ...` line on stderr
naming the problem and a non-zero exit (2 for usage errors), before any training work; no traceback, no
hang, nothing half-written under a final name, nothing non-finite ever saved. A run that diverges stops
with one error line naming the step.

Each case is a command line (run in a fresh folder under a temporary directory, nothing is written into the
repository), an optional setup that makes the files it needs, and an expectation:

    refuse   refused at start: exit != 0, one `error:` line, no training output before it
    fail     refused at start, or stopped later with one `error:` line that names the step
    runs     exit 0
    either   refused at start, or exit 0 (both are documented behaviours)
  and, for faults made while the job runs (a rank stopped or killed, a signal: the case's `during`):
    watchdog exit 124 within --collective-timeout + 10 s of the fault, one line from every other rank naming
             the collective, the step and the stopped rank ("did not arrive"), the last checkpoint loads
    ends     a non-zero exit within 10 s of the fault, no traceback (a killed rank: the launcher ends the job)
    signal   exit 128 + the signal within 10 s, one line "terminated by SIG... at step N; last checkpoint ..."
    startup  a rank stopped before the ranks met: exit 124 within --collective-timeout + 10 s of the fault, a
             line from the waiting ranks (at least one) naming MPI's start-up and the stopped rank

plus post-checks (a file that must or must not exist, the log's end record). Always checked: no `*.tmp`
file is left behind (but by a rank killed while writing one: watchdog and ends), `final.bin` (every train case passes `--save final.bin --log log.jsonl`) is absent
after a failure, and every model or training-state file the run left is finite (read with llmz's readers).

Each outcome is one of:

    OK          as promised (one error line, or a clean run)
    TRACEBACK   a Python traceback in the output
    HANG        no exit within the timeout (a FIFO read that blocks, ...)
    LATE        refused, but only after training started (banner or step lines before the error)
    MULTILINE   more than one line on stderr, or one that is not `error: ...` (warnings, noise)
    WRONG       accepted when it should be refused (or the reverse), or a post-check failed

Prints one line per case (and the command and the first lines of output of each case not OK), then the
tally; exits 1 if any case is not OK.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from llmz.config import GPT2Config, preset
from llmz.data import TOKENS_MAGIC, write_tokens
from llmz.errors import LlmzError
from llmz.files import HEADER_BYTES
from llmz.run.environment import process_state
from llmz.run.launch import rank_pids
from llmz.run.lock import Lock
from llmz.run.model_file import MODEL_MAGIC, load_model
from llmz.run.outputs import JsonLog
from llmz.run.state import latest_checkpoint, load_checkpoint, read_state, write_state
from llmz.run.watchdog import TIMEOUT_EXIT
from llmz.tokenizer import TOKENIZER_MAGIC, write_tokenizer

SHIPPED_VAL = REPO / "data" / "shakespeare_val.bin"
SHIPPED_BYTE_TOKENIZER = REPO / "data" / "byte_tokenizer.bin"

# training output that means the run has started working (LATE if a refusal comes after it)
STARTED = re.compile(r"^(llmz: |model: |batch: |step\s+\d+)")

# The command lines. "{d}" is the case's own folder, "{fx}" the shared fixtures, "{python}" this Python.
TINY = ["--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--sample-tokens", "0", "--device", "cpu",
        "--save", "{d}/final.bin", "--log", "{d}/log.jsonl"]


def train(*flags: str) -> list[str]:
    """llmz.train on a fresh tiny model, 2 steps; the case's flags come last (argparse: the last one wins)."""
    return ["{python}", "-m", "llmz.train", "--model", "tiny", "--steps", "2", *TINY, *flags]


def train_from(*flags: str) -> list[str]:
    """llmz.train without --model (for --init-from and --resume), 4 steps."""
    return ["{python}", "-m", "llmz.train", "--steps", "4", *TINY, *flags]


def diverge(*flags: str) -> list[str]:
    """llmz.train for runs that should diverge: 6 steps, no warmup, a checkpoint every step."""
    return train("--steps", "6", "--warmup-steps", "0", "--checkpoint-dir", "{d}/ck", "--checkpoint-every", "1",
                 *flags)


def convert(*flags: str) -> list[str]:
    return ["{python}", "-m", "llmz.convert", *flags]


def sample(*flags: str) -> list[str]:
    return ["{python}", "-m", "llmz.sample", "--device", "cpu", "--tokens", "5", *flags]


def sample_model(*flags: str) -> list[str]:
    return sample("--init-from", "{fx}/model.bin", *flags)


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


WATCH_TIMEOUT = 5           # --collective-timeout of the cases that stop a rank


def ranks_train(n: int, stage: int, *flags: str) -> list[str]:
    """mpiexec -n n llmz.train on the tiny model, long enough to be stopped midway: a checkpoint every 5 steps,
    the collective watchdog at WATCH_TIMEOUT seconds."""
    return [mpiexec(), "-n", str(n), *train("--steps", "100000", "--comm", "mpi", "--zero-stage", str(stage),
                                            "--checkpoint-dir", "{d}/ck", "--checkpoint-every", "5",
                                            "--collective-timeout", str(WATCH_TIMEOUT), *flags)]


# llmz.train as every rank runs it, but the last rank stops itself (SIGSTOP) the moment it has started a
# reduce-scatter that is still in flight (ZeRO-2 on CPU ranks starts one as each block's backward ends and waits
# for it only when the slot is reused), from step 12 on: frozen with a started collective in flight, every time
STOP_IN_FLIGHT = """import os, runpy, signal
from llmz import comm
started = comm.Communicator.start_reduce_scatter
def start_reduce_scatter(self, buf, op="avg"):
    request = started(self, buf, op)
    if self.rank == self.world_size - 1 and self.watch.step >= 12 and not request.done:
        os.kill(os.getpid(), signal.SIGSTOP)
    return request
comm.Communicator.start_reduce_scatter = start_reduce_scatter
runpy.run_module("llmz.train", run_name="__main__", alter_sys=True)
"""


# llmz.train as every rank runs it, but rank STOP (the first argument) stops itself (SIGSTOP) as it starts, before
# its MPI library is loaded (a stop 0.4 s after launch, made exact), or, with "mpi", just before MPI_Init
STOP_AT_START = """import os, runpy, signal, sys
from llmz.run import launch
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
stop, where = sys.argv.pop(1).split(":")
if rank == int(stop) and where == "start":
    os.kill(os.getpid(), signal.SIGSTOP)
init_thread = launch.init_thread
def stop_first(MPI):
    if rank == int(stop) and where == "mpi":
        os.kill(os.getpid(), signal.SIGSTOP)
    init_thread(MPI)
launch.init_thread = stop_first
runpy.run_module("llmz.train", run_name="__main__", alter_sys=True)
"""


def ranks_train_stopping_at_start(n: int, rank: int, where: str) -> list[str]:
    """mpiexec -n n llmz.train (2 steps, the watchdog at WATCH_TIMEOUT s), rank `rank` stopping itself at start
    ("start": before MPI is loaded; "mpi": just before MPI_Init)."""
    cmd = [mpiexec(), "-n", str(n), *train("--collective-timeout", str(WATCH_TIMEOUT))]
    at = cmd.index("-m")
    return [*cmd[:at], "-c", STOP_AT_START, f"{rank}:{where}", *cmd[at + 2:]]


def ranks_train_stopping_in_flight(n: int, stage: int) -> list[str]:
    """ranks_train, with the last rank stopping itself while a reduce-scatter it started is in flight."""
    cmd = ranks_train(n, stage)
    at = cmd.index("-m")
    return [*cmd[:at], "-c", STOP_IN_FLIGHT, *cmd[at + 2:]]


# ---- writing files, good and bad -------------------------------------------------------------------------
def header(*values: int, dtype: str = "<i4") -> bytes:
    h = np.zeros(256, dtype=dtype)
    h[:len(values)] = values
    return h.tobytes()


def model_header(maxT=64, V=256, L=2, NH=2, C=16, Vp=None, version=3) -> bytes:
    return header(MODEL_MAGIC, version, maxT, V, L, NH, C, Vp if Vp is not None else V)


def write_model(path: Path, fill: float = 0.0, **shape) -> None:
    """A well-formed fp32 model file of `shape` whose every parameter is `fill`."""
    cfg = GPT2Config(max_seq_len=shape.get("maxT", 64), vocab_size=shape.get("V", 256),
                     padded_vocab_size=shape.get("Vp", shape.get("V", 256)), num_layers=shape.get("L", 2),
                     num_heads=shape.get("NH", 2), channels=shape.get("C", 16))
    body = np.full(cfg.num_parameters(), fill, dtype="<f4")
    path.write_bytes(model_header(**shape) + body.tobytes())


def sparse(path: Path, size: int, head: bytes = b"") -> None:
    """A sparse file of `size` bytes (truncate -s), starting with `head`."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def tokens_file(path: Path, tokens, count: int | None = None, magic: int = TOKENS_MAGIC, version: int = 1) -> None:
    tokens = np.asarray(tokens, dtype="<u2")
    path.write_bytes(header(magic, version, len(tokens) if count is None else count) + tokens.tobytes())


def cut(path: Path, nbytes: int) -> None:
    """Drop the last nbytes of a file."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - nbytes])


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def make_fixtures(fx: Path, timeout: float) -> None:
    """Shared inputs: a real tiny model and checkpoint (from one llmz run), good and bad files, FIFOs."""
    cmd = [sys.executable, "-m", "llmz.train", "--model", "tiny", "--max-seq-len", "64", "--steps", "2",
           "--batch-size", "2", "--seq-len", "16", "--val-batches", "1", "--sample-tokens", "0", "--device", "cpu",
           "--save", str(fx / "model.bin"), "--checkpoint-dir", str(fx / "ck")]
    # and another run's checkpoint (another seed): the step folder of it that a case copies in beside ck's
    other = [*cmd[:cmd.index("--save")], "--seed", "7", "--checkpoint-dir", str(fx / "ck_other")]
    other[other.index("--steps") + 1] = "4"
    for c in (cmd, other):
        r = subprocess.run(c, check=False, capture_output=True, text=True, cwd=fx, env=child_env(),
                           timeout=max(timeout, 120))
        if r.returncode != 0:
            sys.exit(f"cannot make the fixtures: {shlex.join(c)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    model = (fx / "model.bin").read_bytes()
    # model files
    (fx / "model_empty.bin").write_bytes(b"")
    (fx / "model_10bytes.bin").write_bytes(model[:10])
    (fx / "model_header_only.bin").write_bytes(model[:HEADER_BYTES])
    (fx / "model_truncated.bin").write_bytes(model[:len(model) // 2])
    (fx / "model_version7.bin").write_bytes(model_header(version=7) + model[HEADER_BYTES:])
    (fx / "model_nh0.bin").write_bytes(model_header(NH=0) + model[HEADER_BYTES:])
    (fx / "model_negative_v.bin").write_bytes(model_header(V=-5, Vp=256) + model[HEADER_BYTES:])
    (fx / "model_huge_layers.bin").write_bytes(model_header(L=2**31 - 1) + model[HEADER_BYTES:])
    nan_body = np.full((len(model) - HEADER_BYTES) // 4, np.nan, dtype="<f4")
    (fx / "model_nan.bin").write_bytes(model[:HEADER_BYTES] + nan_body.tobytes())
    one_inf = np.frombuffer(model[HEADER_BYTES:], dtype="<f4").copy()
    one_inf[100] = np.inf
    (fx / "model_one_inf.bin").write_bytes(model[:HEADER_BYTES] + one_inf.tobytes())
    write_model(fx / "model_v300.bin", V=300, Vp=384)
    (fx / "model_bf16_zeros.bin").write_bytes(model_header(version=5) + bytes((len(model) - HEADER_BYTES) // 2))
    d48 = preset("d48", vocab_size=50257, max_seq_len=1024)
    sparse(fx / "model_d48_sparse.bin", HEADER_BYTES + 4 * d48.num_parameters(),
           model_header(maxT=1024, V=50257, L=48, NH=25, C=1600, Vp=d48.padded_vocab_size))
    l96 = GPT2Config(max_seq_len=1024, vocab_size=50257, padded_vocab_size=50304, num_layers=96, num_heads=25,
                     channels=1600)
    sparse(fx / "model_l96_sparse.bin", HEADER_BYTES + 4 * l96.num_parameters(),
           model_header(maxT=1024, V=50257, L=96, NH=25, C=1600, Vp=50304))
    # token files
    val = SHIPPED_VAL.read_bytes()
    tokens_file(fx / "tok_empty.bin", [])
    tokens_file(fx / "tok_10.bin", np.arange(10) + 65)
    (fx / "tok_odd_size.bin").write_bytes(val + b"\0")
    (fx / "tok_truncated.bin").write_bytes(val[:len(val) // 2])
    tokens_file(fx / "tok_bad_magic.bin", np.arange(1000) % 200, magic=12345)
    tokens_file(fx / "tok_count_2g.bin", np.arange(1000) % 200, count=2**31 - 1)
    tokens_file(fx / "tok_ids_300.bin", np.full(1000, 300))
    # tokenizer files
    write_tokenizer(str(fx / "tk100.bin"), [bytes([i]) for i in range(100)], None)
    write_tokenizer(str(fx / "tk300_eot299.bin"),
                    [bytes([i]) for i in range(256)] + [b"ab" + bytes([65 + i]) for i in range(44)], 299)
    tk = (fx / "tk300_eot299.bin").read_bytes()
    (fx / "tk_truncated.bin").write_bytes(tk[:1500])
    (fx / "tk_zero_length_token.bin").write_bytes(header(TOKENIZER_MAGIC, 2, 2, 1, dtype="<u4") + b"\x00a\x01b")
    (fx / "tk_eot_outside.bin").write_bytes(header(TOKENIZER_MAGIC, 2, 300, 500, dtype="<u4") + tk[HEADER_BYTES:])
    # the special files
    sparse(fx / "sparse_100g.bin", 100 * 2**30)
    os.mkfifo(fx / "fifo")
    (fx / "a_folder").mkdir()
    # a Hugging Face folder of the tiny model (llmz.convert), for the cases that damage a copy of it
    from llmz.convert import to_hf
    to_hf(str(fx / "model.bin"), str(fx / "hf"))
    (fx / "text.txt").write_text("To be, or not to be, that is the question:\n" * 40, encoding="utf-8")


# ---- setups: files a case makes in its own folder {d} --------------------------------------------------
def copy_checkpoint(d: Path) -> Path:
    """A copy of the fixture checkpoint folder at d/ck; returns d/ck/step_000002."""
    shutil.copytree(d.parent / "fixtures" / "ck", d / "ck")
    return d / "ck" / "step_000002"


def ck_without(name: str):
    def setup(d: Path) -> None:
        (copy_checkpoint(d) / name).unlink()
    return setup


def ck_replace_with_fifo(name: str):
    def setup(d: Path) -> None:
        step = copy_checkpoint(d)
        (step / name).unlink()
        os.mkfifo(step / name)
    return setup


def ck_replace_with_folder(name: str):
    def setup(d: Path) -> None:
        step = copy_checkpoint(d)
        (step / name).unlink()
        (step / name).mkdir()
    return setup


def ck_cut(name: str, nbytes: int):
    def setup(d: Path) -> None:
        cut(copy_checkpoint(d) / name, nbytes)
    return setup


def ck_flip(name: str, offset: int):
    def setup(d: Path) -> None:
        path = copy_checkpoint(d) / name
        flip_byte(path, offset if offset >= 0 else path.stat().st_size + offset)
    return setup


def ck_done_garbage(d: Path) -> None:
    (copy_checkpoint(d) / "DONE").write_text("garbage {{{\n")


def ck_other_model(d: Path) -> None:
    shutil.copy(d.parent / "fixtures" / "model_v300.bin", copy_checkpoint(d) / "model.bin")


def ck_nan(d: Path) -> None:
    """A checkpoint that is well-formed (checksums right, model.bin agrees with the state) but NaN throughout."""
    step = copy_checkpoint(d)
    st = read_state(str(step / "state_rank0.bin"))
    meta = {k: v for k, v in st.meta.items() if k != "arrays"}
    arrays = dict(st.arrays)
    arrays["params"] = np.full_like(arrays["params"], np.nan)
    write_state(str(step / "state_rank0.bin"), meta, arrays)
    shutil.copy(d.parent / "fixtures" / "model_nan.bin", step / "model.bin")


def live_lock(rel: str):
    """A lock held by a process that lives (this checker, through llmz's own Lock)."""
    def setup(d: Path) -> None:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        Lock(str(d / rel), "a live run").acquire()
    return setup


def stale_lock(rel: str):
    """A lock left by a process that no longer runs."""
    def setup(d: Path) -> None:
        pid = 4_000_000
        while True:
            try:
                os.kill(pid, 0)
                pid += 1
            except ProcessLookupError:
                break
            except PermissionError:
                pid += 1
        # llmz.run.lock's record, with a pid no process has (no start tick to compare)
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": time.time(),
                                         "tick": None}) + "\n")
    return setup


def make_fifo(rel: str):
    def setup(d: Path) -> None:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(d / rel)
    return setup


def make_folder(rel: str):
    def setup(d: Path) -> None:
        (d / rel).mkdir(parents=True)
    return setup


def live_log(rel: str = "log.jsonl"):
    """An llmz log that a live run writes now (llmz's own JsonLog, held open by this checker: its lock on the
    file is what a run holds)."""
    def setup(d: Path) -> None:
        log = JsonLog(str(d / rel))
        log.write({"event": "start"})
        KEEP_ALIVE.append(log)
    return setup


def symlink(rel: str, target: str):
    def setup(d: Path) -> None:
        os.symlink(target, d / rel)
    return setup


def hardlink(rel: str, target: str):
    def setup(d: Path) -> None:
        os.link(d / target, d / rel)
    return setup


def both(*setups):
    def setup(d: Path) -> None:
        for s in setups:
            s(d)
    return setup


def write_text(rel: str, text: str):
    def setup(d: Path) -> None:
        (d / rel).write_text(text)
    return setup


def zombie_lock(rel: str):
    """A lock whose owner has exited but is not yet reaped (a zombie: a rank that just crashed under mpiexec)."""
    def setup(d: Path) -> None:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        while process_state(child.pid)[0] != "Z":
            time.sleep(0.01)
        KEEP_ALIVE.append(child)                # reaped only when the checker ends
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(json.dumps({"pid": child.pid, "host": socket.gethostname(), "started": time.time(),
                                         "tick": process_state(child.pid)[1]}) + "\n")
    return setup


def other_run_checkpoint(d: Path) -> None:
    """d/ck holds this run's step 2 (seed 1337); step 4 of another run (seed 7) is copied in beside it."""
    fx = d.parent / "fixtures"
    shutil.copytree(fx / "ck", d / "ck")
    shutil.copytree(fx / "ck_other" / "step_000004", d / "ck" / "step_000004")


def two_rank_checkpoint_mixed(d: Path) -> None:
    """A 2-rank checkpoint whose rank-1 state comes from another run of the same shape (another seed)."""
    for folder, seed in (("ck", "1337"), ("ckB", "7")):
        subprocess.run([mpiexec(), "-n", "2", *[a.replace("{python}", sys.executable) for a in train(
            "--steps", "2", "--checkpoint-dir", str(d / folder), "--seed", seed, "--save", str(d / "x.bin"),
            "--log", str(d / "x.jsonl"))]], cwd=d, env=child_env(), capture_output=True, check=True, timeout=300)
    shutil.copy(d / "ckB" / "step_000002" / "state_rank1.bin", d / "ck" / "step_000002" / "state_rank1.bin")
    for junk in ("x.bin", "x.jsonl"):
        (d / junk).unlink()


def data_per_folder(d: Path) -> None:
    """Two folders, each with a t.bin of the same size and other tokens: ranks started in each read either."""
    for name, seed in (("a", 1), ("b", 2)):
        (d / name).mkdir()
        write_tokens(str(d / name / "t.bin"), np.random.default_rng(seed).integers(0, 256, 5000))


def hf_copy(damage=None):
    """A copy of the fixture Hugging Face folder at d/hf, then damage(d / "hf")."""
    def setup(d: Path) -> None:
        shutil.copytree(d.parent / "fixtures" / "hf", d / "hf")
        if damage:
            damage(d / "hf")
    return setup


def deep_json() -> bytes:
    return b"[" * 100_000 + b"]" * 100_000          # deeper than Python's JSON reader goes


def safetensors_of(header: bytes) -> bytes:
    return np.array([len(header)], "<u8").tobytes() + header


def wrapping_shape(hf: Path) -> None:
    """One tensor whose shape's product is 2^64, 0 in int64, as its data_offsets [0, 0] claim."""
    head = {"transformer.wte.weight": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}
    (hf / "model.safetensors").write_bytes(safetensors_of(json.dumps(head).encode()))


def trained_on_a_file_then_rewritten(d: Path) -> None:
    """d/ck: two steps trained on d/t.bin; then t.bin rewritten with other tokens of the same count."""
    write_tokens(str(d / "t.bin"), np.random.default_rng(1).integers(0, 256, 5000))
    subprocess.run([a.replace("{python}", sys.executable) for a in train(
        "--train-data", str(d / "t.bin"), "--checkpoint-dir", str(d / "ck"), "--save", str(d / "x.bin"),
        "--log", str(d / "x.jsonl"))], cwd=d, env=child_env(), capture_output=True, check=True, timeout=300)
    for junk in ("x.bin", "x.jsonl"):
        (d / junk).unlink()
    write_tokens(str(d / "t.bin"), np.random.default_rng(2).integers(0, 256, 5000))


def big_data_per_folder(d: Path) -> None:
    """Two folders, each with a t.bin of 35M tokens (70 MB), the same but for one token in the middle."""
    tokens = np.random.default_rng(3).integers(0, 256, 35_000_000).astype(np.uint16)
    for name in ("a", "b"):
        (d / name).mkdir()
        write_tokens(str(d / name / "t.bin"), tokens)
        tokens[len(tokens) // 2 + 12345] ^= 1


def other_runs_log(d: Path) -> None:
    """other_run_checkpoint, and theirs.jsonl: the finished log of the run of d/ck's step 2 (6 steps, ended),
    with a copy to compare it with afterwards."""
    other_run_checkpoint(d)
    rid = json.loads((d / "ck" / "step_000002" / "DONE").read_text())["run_id"]
    records = [{"event": "start", "run_id": rid, "start_step": 0}] + [{"step": s, "loss": 5.0} for s in range(6)] + \
        [{"event": "checkpoint", "step": 2, "path": "ck/step_000002"}, {"event": "end"}]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (d / "theirs.jsonl").write_text(text)
    (d / "theirs.jsonl.orig").write_text(text)


KEEP_ALIVE: list = []           # what a setup must keep open or unreaped until the checker ends


# ---- faults made while a case runs: each during(proc, d) acts, and returns when it did --------------------------
def steps_logged(d: Path, n: int, proc, limit: float = 240) -> None:
    """Wait until the case's log holds n step records (or the job ends)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit and proc.poll() is None:
        try:
            if sum('"loss"' in line for line in (d / "log.jsonl").read_text().splitlines()) >= n:
                return
        except OSError:
            pass
        time.sleep(0.1)


def to_rank(rank: int, sig: int, after: int = 12):
    """Once `after` steps are logged, send `sig` to one rank of the mpiexec job."""
    def during(proc, d: Path) -> float:
        steps_logged(d, after, proc)
        os.kill(rank_pids(proc.pid)[rank], sig)
        return time.monotonic()
    return during


def stops_itself(rank: int):
    """The case's command makes one rank stop itself: return when its process is seen stopped."""
    def during(proc, d: Path) -> float:
        while proc.poll() is None:
            pid = rank_pids(proc.pid).get(rank)
            if process_state(pid)[0] == "T":
                break
            time.sleep(0.05)
        return time.monotonic()
    return during


def at_launch(rank: int, sig: int, after: float = 0.4):
    """`after` seconds after the launch, once its process is there, send `sig` to one rank (before its MPI
    library is loaded: the ranks have not met)."""
    def during(proc, d: Path) -> float:
        t0 = time.monotonic()
        while proc.poll() is None:
            pid = rank_pids(proc.pid).get(rank)
            if pid is not None and time.monotonic() - t0 >= after:
                os.kill(pid, sig)
                break
            time.sleep(0.01)
        return time.monotonic()
    return during


def to_process(sig: int, after: int = 12):
    """Once `after` steps are logged, send `sig` to the command (a single-process llmz.train)."""
    def during(proc, d: Path) -> float:
        steps_logged(d, after, proc)
        proc.send_signal(sig)
        return time.monotonic()
    return during


# ---- post-checks: each returns a problem (a string) or None ---------------------------------------------
def exists(rel: str):
    def check(d: Path) -> str | None:
        return None if (d / rel).is_file() else f"{rel} was not written"
    return check


def absent(rel: str):
    def check(d: Path) -> str | None:
        return f"{rel} was written" if (d / rel).exists() else None
    return check


def checkpoint_loads(d: Path) -> str | None:
    """The last complete checkpoint under d/ck reads back whole (the job ended around it)."""
    try:
        path = latest_checkpoint(str(d / "ck"))
        if path is None:
            return "no complete checkpoint left"
        load_checkpoint(path)
    except LlmzError as e:
        return f"the last checkpoint does not load: {e}"
    return None


def unchanged(rel: str, text: str):
    def check(d: Path) -> str | None:
        return None if (d / rel).read_text() == text else f"{rel} was changed"
    return check


def log_ended(rel: str = "log.jsonl"):
    def check(d: Path) -> str | None:
        try:
            records = [json.loads(line) for line in (d / rel).read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            return f"{rel} unreadable ({e})"
        return None if any(r.get("event") == "end" for r in records) else f"{rel} has no end record"
    return check


def same_file(rel: str, other: str):
    def check(d: Path) -> str | None:
        return None if (d / rel).read_bytes() == (d / other).read_bytes() else f"{rel} was changed"
    return check


def log_notes(rel: str, words: str):
    """The last start record of a log says `words` in its notes."""
    def check(d: Path) -> str | None:
        starts = [json.loads(line) for line in (d / rel).read_text().splitlines() if '"event": "start"' in line]
        return None if starts and any(words in n for n in starts[-1].get("notes", [])) else \
            f"{rel}'s start record does not say {words!r}"
    return check


def no_tmp_files(d: Path) -> str | None:
    left = [str(p.relative_to(d)) for p in d.rglob("*.tmp")]
    return f"temporary files left: {', '.join(left)}" if left else None


def all_saved_finite(d: Path, planted: tuple[str, ...] = ()) -> str | None:
    """Every llm.c model file and training-state file under d (but the planted ones) holds finite values."""
    bad = []
    for p in sorted(d.rglob("*.bin")):
        rel = str(p.relative_to(d))
        if rel in planted or not p.is_file():
            continue
        try:
            arrays = list(read_state(str(p)).arrays.values()) if p.name.startswith("state_rank") else \
                [load_model(str(p))[1]]
        except LlmzError:
            continue                # not a file llmz wrote (a corrupt input the case planted)
        if not all(np.isfinite(a).all() for a in arrays):
            bad.append(rel)
    return f"non-finite values saved in {', '.join(bad)}" if bad else None


# ---- the cases -----------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    argv: list[str]
    expect: str                                   # refuse | fail | runs | either
    setup: object = None                          # setup(d) before the run
    checks: list = field(default_factory=list)    # after any outcome
    run_checks: list = field(default_factory=list)  # only after exit 0
    timeout: float | None = None                  # None: --timeout
    planted: tuple[str, ...] = ()                 # non-finite files the setup planted on purpose
    during: object = None                         # during(proc, d) while it runs: a fault; returns its time
    ranks: int = 1                                # watchdog: ranks in the job (all but one speak)
    names: str = ""                               # watchdog: what the line must also say (a regex), if anything
    bound: float = 10.0                           # watchdog, ends, signal: seconds from the fault to the end


def start_cases(add) -> None:
    """The baselines, numbers that can never be right, runaway numbers, vocabularies."""
    fx = "{fx}"
    # sanity: the baselines must run
    add("baseline: tiny train run", train(), "runs", run_checks=[exists("final.bin"), log_ended()])
    add("baseline: sample", sample_model(), "runs")
    add("baseline: resume a good checkpoint", train_from("--resume", "{d}/ck/step_000002"), "runs",
        setup=lambda d: copy_checkpoint(d), run_checks=[exists("final.bin")])

    # numbers that can never be right: refused at start
    for flag, value in [("--lr", "nan"), ("--lr", "inf"), ("--lr", "1e300"), ("--lr", "-1"), ("--weight-decay", "nan"),
                        ("--eps", "nan"), ("--eps", "0"), ("--eps", "-1"), ("--eps", "1e-45"), ("--beta1", "1"),
                        ("--grad-clip", "nan"), ("--final-lr-frac", "-1"), ("--max-loss", "0"),
                        ("--warmup-steps", "-5"), ("--val-every", "-1"), ("--seed", "-1"), ("--steps", "-3"),
                        ("--val-batches", "0"), ("--val-batches", "-1"), ("--max-seq-len", "0"),
                        ("--vocab-size", "0"), ("--model", ""), ("--collective-timeout", "1e-9"),
                        ("--collective-timeout", "0.5")]:
        add(f"train {flag} {value!r}", train(flag, value), "refuse")
    add("train --trace at ZeRO stage 0", train("--trace", "{d}/t.json"), "refuse")
    add("train --device gpu without a GPU", train("--device", "gpu"), "refuse")
    add("train --batch-size larger than the data", train("--batch-size", "100000", "--val-data", ""), "refuse")
    add("train --model d48 (does not fit in memory)", train("--model", "d48"), "refuse")

    # runaway numbers that pass the start checks: refused, or stopped naming the step; never saved non-finite
    gone = [absent("final.bin")]
    add("train --lr 1e6 (diverges)", diverge("--lr", "1e6"), "fail", checks=gone)
    add("train --lr 1e30 (diverges)", diverge("--lr", "1e30"), "fail", checks=gone)
    add("train --lr 3e38 (just below fp32 max)", diverge("--lr", "3e38"), "fail", checks=gone)
    add("train --lr 1e30 --max-loss 1e300", diverge("--lr", "1e30", "--max-loss", "1e300"), "fail", checks=gone)
    add("train --lr 1e6 --max-loss 1e30 (huge but maybe finite)", diverge("--lr", "1e6", "--max-loss", "1e30"),
        "either")
    add("train --weight-decay 1e30", diverge("--weight-decay", "1e30"), "fail", checks=gone)
    add("train --max-loss 1e-9 (stops at step 0)", diverge("--max-loss", "1e-9"), "fail", checks=gone)
    add("train --precision fp64 --lr 1e300", diverge("--precision", "fp64", "--lr", "1e300"), "fail", checks=gone)
    add("train --precision bf16 --lr 1e30", diverge("--precision", "bf16", "--lr", "1e30"), "fail", checks=gone)
    add("train --init-from a NaN model", train_from("--init-from", f"{fx}/model_nan.bin"), "fail", checks=gone)
    add("train --init-from a model with one inf", train_from("--init-from", f"{fx}/model_one_inf.bin"), "fail",
        checks=gone)
    add("train --resume a checkpoint holding NaN parameters",
        train_from("--resume", "{d}/ck/step_000002", "--checkpoint-dir", "{d}/ck", "--checkpoint-every", "1"),
        "fail", setup=ck_nan, checks=gone,
        planted=("ck/step_000002/state_rank0.bin", "ck/step_000002/model.bin"))

    # vocabulary: tokenizer against model; refused at start, or a run whose model and log survive
    survive = [exists("final.bin"), log_ended()]
    add("train --vocab-size 50257 with the byte tokenizer (end sample)",
        train("--vocab-size", "50257", "--sample-tokens", "20"), "either", run_checks=survive)
    add("train --vocab-size 300 with the byte tokenizer (end sample)",
        train("--vocab-size", "300", "--sample-tokens", "20"), "either", run_checks=survive)
    add("train --vocab-size 100 < the byte tokenizer's 256", train("--vocab-size", "100"), "refuse")
    # tiny is byte-level whatever the tokenizer (V = 256: one model per preset name), so the data's ids fit the
    # model; ids past the tokenizer's 100 are sampled and printed as the init-from case below does
    add("train --tokenizer of 100 tokens, tiny's V=256 (end sample)",
        train("--tokenizer", f"{fx}/tk100.bin", "--sample-tokens", "20"), "either", run_checks=survive)
    add("train --tokenizer of 300 tokens, eot 299 (end sample)",
        train("--tokenizer", f"{fx}/tk300_eot299.bin", "--sample-tokens", "20"), "either", run_checks=survive)
    add("train --tokenizer of 300 tokens --vocab-size 256",
        train("--tokenizer", f"{fx}/tk300_eot299.bin", "--vocab-size", "256"), "refuse")
    add("train --init-from V=256 model --tokenizer of 300 tokens",
        train_from("--init-from", f"{fx}/model.bin", "--tokenizer", f"{fx}/tk300_eot299.bin"), "refuse")
    add("train --init-from V=256 model --tokenizer of 100 tokens (end sample)",
        train_from("--init-from", f"{fx}/model.bin", "--tokenizer", f"{fx}/tk100.bin", "--sample-tokens", "20"),
        "either", run_checks=survive)
    add("train --tokenizer gpt2 (tiktoken may be missing)", train("--tokenizer", "gpt2"), "either",
        run_checks=survive)
    add("train --train-data with token ids >= V", train("--train-data", f"{fx}/tok_ids_300.bin"), "refuse")



def special_file_cases(add) -> None:
    """A FIFO, /dev/zero, a 100 GB sparse file and a folder where a file belongs."""
    fx = "{fx}"
    # special files as inputs: a FIFO, /dev/zero, a 100 GB sparse file, a folder
    for what, path in [("a FIFO", f"{fx}/fifo"), ("/dev/zero", "/dev/zero"),
                       ("a 100G sparse file", f"{fx}/sparse_100g.bin"), ("a folder", f"{fx}/a_folder")]:
        add(f"train --init-from {what}", train_from("--init-from", path), "refuse")
        add(f"train --train-data {what}", train("--train-data", path), "refuse")
        if what in ("a FIFO", "a 100G sparse file"):
            add(f"train --val-data {what}", train("--val-data", path), "refuse")
        if what != "a folder":
            add(f"train --tokenizer {what}", train("--tokenizer", path), "refuse")
        add(f"sample --init-from {what}", sample("--init-from", path), "refuse")
        if what != "a folder":
            add(f"sample --tokenizer {what}", sample_model("--tokenizer", path), "refuse")
    add("train --init-from a sparse file with a d48 header", train_from("--init-from", f"{fx}/model_d48_sparse.bin"),
        "refuse")
    add("sample --init-from a sparse file with an L=96 C=1600 header (too big for memory)",
        sample("--init-from", f"{fx}/model_l96_sparse.bin"), "refuse")


def file_cases(add) -> None:
    """Outputs, and data, model, tokenizer and checkpoint files wrong in every way a file can be."""
    fx = "{fx}"
    survive = [exists("final.bin"), log_ended()]            # the model and the log, whole
    # outputs
    add("train --log a folder", train("--log", "{d}/out"), "refuse", setup=make_folder("out"))
    add("train --save a folder", train("--save", "{d}/out"), "refuse", setup=make_folder("out"))
    add("train --save a FIFO", train("--save", "{d}/out.bin"), "refuse", setup=make_fifo("out.bin"))
    add("train --log a FIFO", train("--log", "{d}/out.jsonl"), "refuse", setup=make_fifo("out.jsonl"))
    add("train --save /dev/null", train("--save", "/dev/null"), "refuse")
    add("train --checkpoint-dir a file", train("--checkpoint-dir", f"{fx}/model.bin"), "refuse")
    add("train --log and --save the same file", train("--log", "{d}/same", "--save", "{d}/same"), "refuse",
        checks=[absent("same")])
    add("train --log runs/new/a.jsonl (parents created)", train("--log", "{d}/runs/new/a.jsonl"), "runs",
        run_checks=[log_ended("runs/new/a.jsonl")])
    add("train --save new/sub/m.bin (parents created)", train("--save", "{d}/new/sub/m.bin"), "runs",
        run_checks=[exists("new/sub/m.bin")])
    add("train --log locked by a live run", train(), "refuse", setup=live_lock("log.jsonl.lock"))
    add("train --log with a stale lock", train(), "runs", setup=stale_lock("log.jsonl.lock"),
        run_checks=[log_ended()])

    # validation and training data
    add("train --val-data empty token file", train("--val-data", f"{fx}/tok_empty.bin"), "refuse")
    add("train --val-data 10 tokens", train("--val-data", f"{fx}/tok_10.bin"), "refuse")
    add("train --val-data '' (no validation)", train("--val-data", ""), "runs", run_checks=survive)
    add("train --val-batches 100000 (more than the val data)", train("--val-batches", "100000"), "either",
        run_checks=survive)
    for name in ["tok_empty", "tok_odd_size", "tok_truncated", "tok_bad_magic", "tok_count_2g"]:
        add(f"train --train-data {name}", train("--train-data", f"{fx}/{name}.bin"), "refuse")
    add("train --train-data a model file", train("--train-data", f"{fx}/model.bin"), "refuse")
    add("train --train-data a glob matching nothing", train("--train-data", "{d}/nothing*.bin"), "refuse")

    # model files: --init-from and llmz.sample
    for name in ["model_empty", "model_header_only", "model_truncated", "model_version7", "model_nh0",
                 "model_huge_layers"]:
        add(f"train --init-from {name}", train_from("--init-from", f"{fx}/{name}.bin"), "refuse")
    for name in ["model_10bytes", "model_truncated", "model_negative_v"]:
        add(f"sample --init-from {name}", sample("--init-from", f"{fx}/{name}.bin"), "refuse")
    add("train --init-from a token file", train_from("--init-from", str(SHIPPED_VAL)), "refuse")
    add("train --init-from X --model small (conflict)",
        train_from("--init-from", f"{fx}/model.bin", "--model", "small"), "refuse")
    add("train --init-from X --vocab-size 300 (conflict)",
        train_from("--init-from", f"{fx}/model.bin", "--vocab-size", "300"), "refuse")
    add("train --init-from X (maxT 64) --seq-len 128", train_from("--init-from", f"{fx}/model.bin", "-t", "128"),
        "refuse")
    add("train --init-from X --model tiny (agrees)", train_from("--init-from", f"{fx}/model.bin", "--model", "tiny"),
        "runs", run_checks=survive)
    add("train --init-from a bf16 model of zeros", train_from("--init-from", f"{fx}/model_bf16_zeros.bin"), "either",
        run_checks=survive)

    # tokenizer files
    for name in ["tk_truncated", "tk_zero_length_token", "tk_eot_outside"]:
        add(f"train --tokenizer {name}", train("--tokenizer", f"{fx}/{name}.bin"), "refuse")
    add("sample --tokenizer tk_truncated", sample_model("--tokenizer", f"{fx}/tk_truncated.bin"), "refuse")

    # llmz.sample
    for flag, value in [("--tokens", "-1"), ("--temperature", "-1"), ("--temperature", "nan"), ("--seq-len", "100"),
                        ("--seed", "-1")]:
        add(f"sample {flag} {value!r}", sample_model(flag, value), "refuse")
    add("sample without --init-from", sample(), "refuse")
    add("sample --temperature 0", sample_model("--temperature", "0"), "runs")
    add("sample --temperature 1e300", sample_model("--temperature", "1e300"), "either")
    add("sample a NaN model", sample("--init-from", f"{fx}/model_nan.bin"), "fail")
    add("sample a model with one inf", sample("--init-from", f"{fx}/model_one_inf.bin"), "fail")
    add("sample a V=300 model of zeros with the byte tokenizer", sample("--init-from", f"{fx}/model_v300.bin"), "runs")
    add("sample --tokenizer llm.c file, 300 tokens, eot 299, no prompt (V=256 model)",
        sample_model("--tokenizer", f"{fx}/tk300_eot299.bin"), "either")
    add("sample --tokenizer llm.c file, 100 tokens, no prompt", sample_model("--tokenizer", f"{fx}/tk100.bin"),
        "runs")
    add("sample --tokenizer llm.c file, 100 tokens --prompt",
        sample_model("--tokenizer", f"{fx}/tk100.bin", "--prompt", "hi"), "refuse")
    add("sample --tokenizer shipped byte tokenizer file --prompt",
        sample_model("--tokenizer", str(SHIPPED_BYTE_TOKENIZER), "--prompt", "ROMEO:"), "runs")


def checkpoint_cases(add) -> None:
    """Checkpoint folders: damaged, foreign, of another run."""
    fx = "{fx}"
    survive = [exists("final.bin"), log_ended()]            # the model and the log, whole
    # checkpoint folders
    resume = ("--resume", "{d}/ck/step_000002")
    add("train --resume a non-existent folder", train_from("--resume", "{d}/nowhere/step_000002"), "refuse")
    add("train --resume latest without --checkpoint-dir", train_from("--resume", "latest"), "refuse")
    add("train --resume latest, empty --checkpoint-dir (starts afresh)",
        train("--resume", "latest", "--checkpoint-dir", "{d}/ck"), "runs", run_checks=survive)
    add("train --resume latest, good --checkpoint-dir", train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck"),
        "runs", setup=lambda d: copy_checkpoint(d), run_checks=survive)
    add("train --resume the checkpoint root, not a step folder", train_from("--resume", "{d}/ck"), "refuse",
        setup=lambda d: copy_checkpoint(d))
    add("checkpoint without DONE", train_from(*resume), "refuse", setup=ck_without("DONE"))
    add("checkpoint without model.bin", train_from(*resume), "refuse", setup=ck_without("model.bin"))
    add("checkpoint without state_rank0.bin", train_from(*resume), "refuse", setup=ck_without("state_rank0.bin"))
    add("checkpoint model.bin truncated", train_from(*resume), "refuse", setup=ck_cut("model.bin", 100))
    add("checkpoint state truncated", train_from(*resume), "refuse", setup=ck_cut("state_rank0.bin", 100))
    add("checkpoint state with a flipped array byte", train_from(*resume), "refuse",
        setup=ck_flip("state_rank0.bin", -5))
    add("checkpoint model.bin is a FIFO", train_from(*resume), "refuse", setup=ck_replace_with_fifo("model.bin"))
    add("checkpoint state_rank0.bin is a FIFO", train_from(*resume), "refuse",
        setup=ck_replace_with_fifo("state_rank0.bin"))
    add("checkpoint model.bin of another model (V=300)", train_from(*resume), "refuse", setup=ck_other_model)
    add("checkpoint DONE holds garbage", train_from(*resume), "either", setup=ck_done_garbage, run_checks=survive)
    add("train --resume X --init-from Y (conflict)", train_from(*resume, "--init-from", f"{fx}/model.bin"), "refuse",
        setup=lambda d: copy_checkpoint(d))
    add("train --resume X --model small (conflict)", train_from(*resume, "--model", "small"), "refuse",
        setup=lambda d: copy_checkpoint(d))
    add("train --resume X with another batch size", train_from(*resume, "--batch-size", "4"), "either",
        setup=lambda d: copy_checkpoint(d), run_checks=survive)
    add("train afresh into a --checkpoint-dir holding later checkpoints", train("--checkpoint-dir", "{d}/ck"),
        "refuse", setup=lambda d: copy_checkpoint(d))
    add("train --checkpoint-dir locked by a live run", train("--checkpoint-dir", "{d}/ck"), "refuse",
        setup=live_lock("ck/llmz.lock"))
    add("train --checkpoint-dir with a stale lock", train("--checkpoint-dir", "{d}/ck"), "runs",
        setup=stale_lock("ck/llmz.lock"), run_checks=survive)


def name_cases(add) -> None:
    """One file under other names, logs that are not logs, names the filesystem cannot hold, prompts, signals."""
    survive = [exists("final.bin"), log_ended()]            # the model and the log, whole
    # outputs: the same file under another name; a --log that is not a log; names the filesystem cannot hold
    notes = "my notes\nline 2\n"
    add("train --log alias.jsonl -> log.jsonl, locked by a live run", train("--log", "{d}/alias.jsonl"),
        "refuse", setup=both(live_lock("log.jsonl.lock"), symlink("alias.jsonl", "log.jsonl")))
    add("train --log a hard link of a log a live run writes", train("--log", "{d}/hard.jsonl"), "refuse",
        setup=both(live_log(), hardlink("hard.jsonl", "log.jsonl")))
    add("train --log DIR/./log.jsonl, locked by a live run", train("--log", "{d}/./log.jsonl"), "refuse",
        setup=live_lock("log.jsonl.lock"))
    add("train --checkpoint-dir a symlink to a folder locked by a live run",
        train("--checkpoint-dir", "{d}/alias"), "refuse", setup=both(live_lock("ck/llmz.lock"), symlink("alias", "ck")))
    add("train --log notes.txt (not an llmz log)", train("--log", "{d}/notes.txt"), "refuse",
        setup=write_text("notes.txt", notes), checks=[unchanged("notes.txt", notes)])
    add("train --resume latest --log notes.txt (not an llmz log)",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--log", "{d}/notes.txt"), "refuse",
        setup=both(copy_checkpoint, write_text("notes.txt", notes)), checks=[unchanged("notes.txt", notes)])
    add("train --resume --log with a note typed into the middle of it",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--log", "{d}/run.jsonl"), "refuse",
        setup=both(copy_checkpoint, write_text("run.jsonl", '{"event": "start"}\nmy note\n{"step": 0}\n')))
    add("train --resume --log whose last line is torn (a crash)",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--log", "{d}/run.jsonl"), "runs",
        setup=both(copy_checkpoint, write_text("run.jsonl", '{"event": "start"}\n{"step": 0, "lo')),
        run_checks=[log_ended("run.jsonl")])
    add("train --resume latest takes a step folder copied from another run",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--steps", "6"), "refuse",
        setup=other_run_checkpoint)
    add("train --resume latest --resume-other-run takes it, as told",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--steps", "6", "--resume-other-run"),
        "runs", setup=other_run_checkpoint, run_checks=survive)
    long = "m" * 251
    add("train --save a 255-byte name (fits)", train("--save", f"{{d}}/{long}.bin"), "runs",
        run_checks=[exists(f"{long}.bin")])
    add("train --log and --checkpoint-dir of 255-byte names (fit)",
        train("--log", f"{{d}}/{long}.log", "--checkpoint-dir", f"{{d}}/{long}.ckp"), "runs",
        run_checks=[log_ended(f"{long}.log")])
    add("train --save a 256-byte name", train("--save", f"{{d}}/{long}x.bin"), "refuse")
    add("train --save a 260-byte name", train("--save", f"{{d}}/{long}xxxxx.bin"), "refuse")
    add("train --log a 256-byte name", train("--log", f"{{d}}/{long}.json"), "refuse")
    add("train --trace whose picture's name would be 258 bytes",
        train("--trace", "{d}/" + "t" * 254, "--zero-stage", "2"), "refuse")
    add("train --checkpoint-dir a path too long for the files inside",
        train("--checkpoint-dir", "{d}/" + "/".join(["c" * 250] * 16)), "refuse")
    add("train --log with a lock of a zombie process (a rank just crashed)", train(), "runs",
        setup=zombie_lock("log.jsonl.lock"), run_checks=[log_ended()])
    add("train --checkpoint-dir with a lock of a zombie process", train("--checkpoint-dir", "{d}/ck"), "runs",
        setup=zombie_lock("ck/llmz.lock"), run_checks=survive)

    # llmz.sample: any bytes in a prompt; a bounded number of tokens
    for what, prompt in [("bytes that are not UTF-8", "ab\udcff\udcfe"), ("an encoded surrogate", "\udced\udca0\udc80x")]:
        add(f"sample --prompt with {what}", sample_model("--prompt", prompt), "runs")
    for value in ("1000001", "1000000000", "9223372036854775808"):
        add(f"sample --tokens {value}", sample_model("--tokens", value), "refuse")
    add("train --sample-tokens 1000000000", train("--sample-tokens", "1000000000"), "refuse")

    # signals: SIGTERM and SIGHUP end a run as Ctrl-C does
    for sig in (signal.SIGTERM, signal.SIGHUP):
        add(f"train, {sig.name} while it runs", train("--steps", "100000", "--checkpoint-dir", "{d}/ck",
                                                      "--checkpoint-every", "5"),
            "signal", during=to_process(sig), checks=[checkpoint_loads], timeout=300)


def rank_cases(add) -> None:
    """Several ranks: a rank that fails or never arrives, data known by its content."""
    # several ranks
    mpi = [mpiexec(), "-n", "2"]
    add("mpiexec -n 2 with ranks that read different data (a relative --train-data from two folders)",
        [mpiexec(), "-n", "1", "-wdir", "{d}/a", *train("--train-data", "t.bin"), ":", "-n", "1", "-wdir", "{d}/b",
         *train("--train-data", "t.bin")], "refuse", setup=data_per_folder, timeout=120)
    add("mpiexec -n 2, a checkpoint whose rank-1 state is of another run (one line, not one per rank)",
        [*mpi, *train_from("--resume", "{d}/ck/step_000002")], "refuse", setup=two_rank_checkpoint_mixed,
        timeout=120)
    add("mpiexec -n 2 under ulimit -f 50 (MPI's shared memory cannot start)",
        ["bash", "-c", 'ulimit -f 50 && exec "$@"', "bash", *mpi, *train()], "refuse", timeout=60)
    for n in (2, 3):
        for stage in (0, 1, 2, 3):
            add(f"watchdog: {n} ranks, stage {stage}, one rank stopped (SIGSTOP)", ranks_train(n, stage), "watchdog",
                during=to_rank(n - 1, signal.SIGSTOP), ranks=n, bound=WATCH_TIMEOUT + 10,
                checks=[checkpoint_loads], timeout=300)
    add("watchdog: 2 ranks, stage 2, one rank stopped (SIGSTOP) with a reduce-scatter it started in flight",
        ranks_train_stopping_in_flight(2, 2), "watchdog", during=stops_itself(1), ranks=2, bound=WATCH_TIMEOUT + 10,
        names=r": reduce_scatter #\d+ .*rank 1 \(it stopped inside (it|reduce_scatter #\d+ at step \d+);",
        checks=[checkpoint_loads], timeout=300)
    add("watchdog: 3 ranks, stage 2, rank 0 stopped", ranks_train(3, 2), "watchdog", during=to_rank(0, signal.SIGSTOP),
        ranks=3, bound=WATCH_TIMEOUT + 10, checks=[checkpoint_loads], timeout=300)
    add("watchdog: 2 ranks, stage 2, bf16, one rank stopped", ranks_train(2, 2, "--precision", "bf16"), "watchdog",
        during=to_rank(1, signal.SIGSTOP), ranks=2, bound=WATCH_TIMEOUT + 10, checks=[checkpoint_loads], timeout=300)
    add("2 ranks, stage 2, one rank killed (SIGKILL)", ranks_train(2, 2), "ends", during=to_rank(1, signal.SIGKILL),
        checks=[checkpoint_loads], timeout=300)
    add("3 ranks, stage 3, one rank killed (SIGKILL)", ranks_train(3, 3), "ends", during=to_rank(2, signal.SIGKILL),
        checks=[checkpoint_loads], timeout=300)
    add("2 ranks, SIGTERM to every rank (mpiexec forwards it)", ranks_train(2, 1), "signal",
        during=to_process(signal.SIGTERM), checks=[checkpoint_loads], timeout=300)

    # before the ranks meet: a rank that cannot start MPI says why in its own line and ends the job; one stopped,
    # killed or ended before the ranks met is named by the others (or the launcher ends the job)
    limited = ["bash", "-c", 'ulimit -f 8000 && exec "$@"', "bash"]
    for n, stage in [(2, 0), (2, 1), (2, 2), (2, 3), (3, 2)]:
        flags = ("--zero-stage", str(stage))
        rest = [":", "-n", str(n - 2), *train(*flags)] if n > 2 else []
        add(f"mpiexec -n {n}, stage {stage}, rank 1 under ulimit -f 8000 (cannot start MPI: its own line)",
            [mpiexec(), "-n", "1", *train(*flags), ":", "-n", "1", *limited, *train(*flags), *rest], "refuse",
            timeout=60)
    for n, rank, where in [(2, 1, "start"), (3, 2, "start"), (3, 0, "start"), (2, 1, "mpi"), (3, 0, "mpi")]:
        words = {"start": "before MPI's start-up", "mpi": "inside MPI's start-up"}[where]
        add(f"start-up watchdog: {n} ranks, rank {rank} stopped (SIGSTOP) {words} (before the ranks meet)",
            ranks_train_stopping_at_start(n, rank, where), "startup", during=stops_itself(rank), ranks=n,
            bound=WATCH_TIMEOUT + 10, names=rf"rank {rank} \(its process, pid \d+, is stopped: .*, {words}\)",
            timeout=120)
    add("start-up watchdog: 2 ranks, rank 1 stopped (SIGSTOP) 0.4 s after launch (before or after the ranks meet)",
        [mpiexec(), "-n", "2", *train("--collective-timeout", str(WATCH_TIMEOUT))], "either-watchdog",
        during=at_launch(1, signal.SIGSTOP), ranks=2, bound=WATCH_TIMEOUT + 10, timeout=120)
    add("2 ranks, rank 1 killed (SIGKILL) 0.4 s after launch, before MPI starts", [mpiexec(), "-n", "2", *train()],
        "ends", during=at_launch(1, signal.SIGKILL), timeout=120)
    add("mpiexec -n 2, rank 1 ends (exit 3) before the ranks meet (named at once)",
        [mpiexec(), "-n", "1", *train(), ":", "-n", "1", "{python}", "-c", "import sys, time; time.sleep(1); sys.exit(3)"],
        "fail", timeout=60)

    # a run's data known by its content; a log trimmed only by its own run
    add("train --resume latest after the training file was rewritten (other text, the same token count)",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--train-data", "{d}/t.bin"), "refuse",
        setup=trained_on_a_file_then_rewritten, timeout=120)
    add("train --resume latest --resume-other-data after the training file was rewritten (goes on, says so)",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--train-data", "{d}/t.bin",
                   "--resume-other-data"), "runs", setup=trained_on_a_file_then_rewritten, timeout=120,
        run_checks=[log_ended(), log_notes("log.jsonl", "going on, as --resume-other-data says")])
    add("mpiexec -n 2 with 70 MB files that differ in one token in the middle (a relative --train-data)",
        [mpiexec(), "-n", "1", "-wdir", "{d}/a", *train("--train-data", "t.bin"), ":", "-n", "1", "-wdir", "{d}/b",
         *train("--train-data", "t.bin")], "refuse", setup=big_data_per_folder, timeout=180)
    add("train --resume latest --resume-other-run --log theirs.jsonl (another run's finished log)",
        train_from("--resume", "latest", "--checkpoint-dir", "{d}/ck", "--steps", "6", "--resume-other-run", "--log",
                   "{d}/theirs.jsonl"), "refuse", setup=other_runs_log,
        checks=[same_file("theirs.jsonl", "theirs.jsonl.orig")])


def odd_input_cases(add) -> None:
    """The last odd inputs, and a bad flag that must end the whole job at once."""
    fx = "{fx}"
    survive = [exists("final.bin"), log_ended()]            # the model and the log, whole
    # the last odd inputs: JSON nested 100,000 deep, a shape whose product wraps, a stdout that takes nothing,
    # a refused conversion's folder, the longest prefix llmz.prepare takes
    deep = deep_json()
    to_new = ("--to-llmc", "{d}/new/out.bin")
    add("convert a safetensors header nested 100,000 deep", convert("{d}/hf", *to_new), "fail",
        setup=hf_copy(lambda hf: (hf / "model.safetensors").write_bytes(safetensors_of(deep))), checks=[absent("new")])
    add("convert a config.json nested 100,000 deep", convert("{d}/hf", *to_new), "refuse",
        setup=hf_copy(lambda hf: (hf / "config.json").write_bytes(deep)), checks=[absent("new")])
    add("convert a tensor whose shape's product wraps to 0 in int64", convert("{d}/hf", *to_new), "fail",
        setup=hf_copy(wrapping_shape), checks=[absent("new")])
    add("convert a NaN model --to-hf out (leaves no out/)", convert(f"{fx}/model_nan.bin", "--to-hf", "{d}/out"),
        "fail", checks=[absent("out")])
    add("convert the tiny model --to-hf new/hf (baseline)", convert(f"{fx}/model.bin", "--to-hf", "{d}/new/hf"), "runs",
        run_checks=[exists("new/hf/config.json"), exists("new/hf/model.safetensors")])
    add("python -m llmz.doctor > /dev/full", ["bash", "-c", '"$@" > /dev/full', "bash", "{python}", "-m", "llmz.doctor"],
        "fail")
    prefix = "p" * 241
    add("prepare -o a 241-character prefix (its final names fit in 255)",
        ["{python}", "-m", "llmz.prepare", f"{fx}/text.txt", "-o", f"{{d}}/{prefix}"], "runs",
        run_checks=[exists(f"{prefix}_{part}.bin") for part in ("train", "val", "tokenizer")])
    add("train --log whose first line is JSON nested 100,000 deep", train("--log", "{d}/deep.jsonl"), "refuse",
        setup=lambda d: (d / "deep.jsonl").write_bytes(deep + b"\n"))
    add("checkpoint DONE nested 100,000 deep", train_from("--resume", "{d}/ck/step_000002"), "either",
        setup=lambda d: (copy_checkpoint(d) / "DONE").write_bytes(deep), run_checks=survive)
    add("train --checkpoint-dir whose lock file is nested 100,000 deep", train("--checkpoint-dir", "{d}/ck"), "either",
        setup=lambda d: (d / "ck").mkdir() or (d / "ck" / "llmz.lock").write_bytes(deep), run_checks=survive)

    # two ranks: a bad flag must end the whole job at once
    mpi = [mpiexec(), "-n", "2"]
    add("mpiexec -n 2 train --steps -3", [*mpi, "{python}", "-m", "llmz.train", "--steps", "-3"], "refuse",
        timeout=20)
    add("mpiexec -n 2 train --init-from a FIFO", [*mpi, *train_from("--init-from", f"{fx}/fifo")], "refuse",
        timeout=20)


def cases() -> list[Case]:
    c = []

    def add(name, argv, expect, **kw):
        c.append(Case(name, argv, expect, **kw))

    for group in (start_cases, special_file_cases, file_cases, checkpoint_cases, name_cases, rank_cases, odd_input_cases):
        group(add)
    return c


# ---- running and judging one case ------------------------------------------------------------------------
def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("LLMZ_DEBUG", None)
    return env


def run(cmd: list[str], cwd: Path, timeout: float, during=None) -> tuple[int | None, str, str, float, float | None]:
    """-> (exit status or None on timeout, stdout, stderr, seconds, seconds from the fault `during` made to the
    end, or None). On a timeout the whole process group (mpiexec and its ranks too) is killed."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    # a fault made while it runs: the pipes are read meanwhile, so that a chatty job never blocks on them
    fault = []
    if during is not None:
        import threading
        threading.Thread(target=lambda: fault.append(during(p, cwd)), daemon=True).start()
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    end = time.monotonic()
    return rc, out, err, end - t0, end - fault[0] if fault else None


# The waiting ranks' lines of a case that stops a rank, by its expect: the pattern every line matches, whether
# every waiting rank says it (else one at least: the stop's moment, which the load decides, says who notices),
# and whether each names case.names
WATCH_LINES = {
    "watchdog": (re.compile(r"^rank \d+: error: collective watchdog: \w+ #\d+ at step \d+ .*: .*rank \d+ \(.*\) "
                            r"did not arrive$"), True, True),
    # a stop before or after MPI_Init
    "either-watchdog": (re.compile(r"^rank \d+: error: collective watchdog: .*: .*rank \d+ \(.*\) did not arrive$"),
                        False, False),
    "startup": (re.compile(r"^rank \d+: error: collective watchdog: MPI's start-up \(MPI_Init\) did not complete "
                           r"within --collective-timeout \S+ s: .*rank \d+ \(.*\) did not arrive$"), False, True),
}


def judge_fault(case: Case, rc: int, err_lines: list[str], took: float | None) -> tuple[str, str]:
    """The faults made while a job runs: watchdog, ends, signal (see the module docstring)."""
    if took is None:
        return "WRONG", "the job ended before the fault was made"
    if took > case.bound:
        return "HANG", f"ended {took:.1f} s after the fault, beyond {case.bound:g} s"
    if case.expect in WATCH_LINES:
        pattern, every, named = WATCH_LINES[case.expect]
        if rc != TIMEOUT_EXIT:
            return "WRONG", f"exit {rc}, not {TIMEOUT_EXIT}: {err_lines[-1] if err_lines else '(no line)'}"
        said = len(err_lines) == case.ranks - 1 if every else 1 <= len(err_lines) <= case.ranks - 1
        if not said or not all(pattern.match(line) for line in err_lines):
            return "MULTILINE", f"{len(err_lines)} lines from {case.ranks - 1} waiting ranks: {err_lines[:1]}"
        if named and not all(re.search(case.names, line) for line in err_lines):
            return "WRONG", f"the line does not say /{case.names}/: {err_lines[0]}"
        return "OK", f"{took:.1f} s after the stop: {err_lines[0]}"
    if case.expect == "ends":
        return ("OK", f"exit {rc} {took:.1f} s after the kill" + (f": {err_lines[0]}" if err_lines else "")) \
            if rc else ("WRONG", "exit 0 after a rank was killed")
    sig = next(s for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT) if s.name in case.name)
    line = err_lines[0].split(": ", 1)[-1] if len(err_lines) == 1 else ""
    if rc != 128 + sig or not re.match(rf"terminated by {sig.name} at step \d+; last checkpoint ", line):
        return "WRONG", f"exit {rc}, lines {err_lines[:2]}"
    return "OK", f"{took:.1f} s after the signal: {line}"


def judge(case: Case, rc: int | None, out: str, err: str, problems: list[str],
          took: float | None = None) -> tuple[str, str]:
    """-> (class, what happened in a few words)."""
    if rc is None:
        return "HANG", "no exit within the timeout"
    if "Traceback (most recent call last)" in out + err:
        last = [line for line in (out + err).splitlines() if line.strip()]
        return "TRACEBACK", last[-1] if last else ""
    err_lines = [line for line in err.splitlines() if line.strip()]
    if case.expect in ("ends", "signal", *WATCH_LINES):
        cls, what = judge_fault(case, rc, err_lines, took)
        return ("WRONG", "; ".join(problems)) if cls == "OK" and problems else (cls, what)
    started = any(STARTED.match(line) for line in out.splitlines())
    if rc == 0:
        noise = [line for line in err_lines if not line.startswith("note:")]
        if case.expect in ("refuse", "fail"):
            return "WRONG", "accepted (exit 0), should be refused"
        if noise:
            return "MULTILINE", f"exit 0 but stderr says: {noise[0]}"
        if problems:
            return "WRONG", "; ".join(problems)
        return "OK", "ran"
    # a failure
    if case.expect == "runs":
        return "WRONG", f"refused (exit {rc}), should run: {err_lines[-1] if err_lines else '(no message)'}"
    if not err_lines:
        return "MULTILINE", f"exit {rc} with no error line"
    line = re.sub(r"^rank \d+: ", "", err_lines[-1])     # a rank's own line: "rank R: error: ..."
    if not line.startswith("error:"):
        return "MULTILINE", f"last stderr line is not 'error: ...': {line}"
    if len(err_lines) > 1:
        return "MULTILINE", f"{len(err_lines)} lines on stderr, first: {err_lines[0]}"
    if started and case.expect in ("refuse", "either"):
        return "LATE", f"refused after training output: {line}"
    if started and not re.search(r"\bstep \d+", line):
        return "WRONG", f"stopped without naming the step: {line}"
    if problems:
        return "WRONG", "; ".join(problems)
    return "OK", line


def run_case(case: Case, root: Path, n: int, timeout: float) -> tuple[str, str, str, float, int | None, str]:
    d = root / f"case{n:03d}"
    d.mkdir()
    if case.setup:
        case.setup(d)
    cmd = [a.replace("{python}", sys.executable).replace("{fx}", str(root / "fixtures")).replace("{d}", str(d))
           for a in case.argv]
    rc, out, err, secs, took = run(cmd, d, case.timeout or timeout, case.during)
    # a rank stopped then killed (watchdog, ends) may leave the temporary file it was writing: never a final name
    always = [] if case.expect in ("ends", *WATCH_LINES) else [no_tmp_files]
    problems = [p for check in case.checks + always for p in [check(d)] if p]
    problems += [p for p in [all_saved_finite(d, case.planted)] if p]
    if rc == 0:
        problems += [p for check in case.run_checks for p in [check(d)] if p]
    elif rc is not None:
        problems += [p for p in [absent("final.bin")(d)] if p]
    cls, what = judge(case, rc, out, err, problems, took)
    shown = " ".join(shlex.quote(a) for a in cmd).replace(str(root), "$TMP").replace(sys.executable, "python")
    text = (err + ("\n" if err and out else "") + out).strip()
    return cls, what, shown, secs, rc, text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", default="", metavar="SUBSTRING", help="run only the cases whose name contains this")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="seconds before a case is a HANG")
    args = p.parse_args(argv)
    chosen = [c for c in cases() if args.k.lower() in c.name.lower()]
    if not chosen:
        print(f"no case matches {args.k!r}")
        return 1
    classes = ["OK", "TRACEBACK", "HANG", "LATE", "MULTILINE", "WRONG"]
    tally = dict.fromkeys(classes, 0)
    exit_not_2 = []             # refused as promised, but with exit status 1 where usage errors promise 2
    with tempfile.TemporaryDirectory(prefix="hostile_check.") as tmp:
        root = Path(tmp)
        (root / "fixtures").mkdir()
        make_fixtures(root / "fixtures", args.timeout)
        for n, case in enumerate(chosen):
            cls, what, shown, secs, rc, text = run_case(case, root, n, args.timeout)
            tally[cls] += 1
            if cls == "OK" and case.expect == "refuse" and rc != 2:
                exit_not_2.append(case.name)
            print(f"{cls:9s} {case.name}  [expect {case.expect}, exit {rc}, {secs:.1f}s]: {what}"[:300], flush=True)
            if cls != "OK":
                print(f"    $ {shown}")
                for line in text.splitlines()[:6]:
                    print(f"    | {line[:200]}")
    bad = len(chosen) - tally["OK"]
    print(f"\n{len(chosen)} cases: {tally['OK']} one-line as promised (or ran clean), "
          + ", ".join(f"{tally[k]} {k}" for k in classes[1:]))
    if exit_not_2:
        print(f"note: {len(exit_not_2)} of the OK refusals exit 1, not 2: {'; '.join(exit_not_2)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
