"""Nothing lost, nothing hung (tools/hostile_check.py re-measures it from outside), class by class: readers
refuse non-regular files without blocking and check a header against the file's size and the memory before
reading any payload; nothing non-finite is ever saved and a diverging run stops naming the step; the end of a
run loses nothing when something fails after the loop; --log lives under its own name and a resume continues
it; --keep never deletes a later checkpoint; a checkpoint folder or log in use is locked; Ctrl-C is one line;
a bad flag on one rank of mpiexec ends the job within seconds. Runs are tiny and on the CPU, mostly in this
process."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import llmz.files
from llmz.config import preset
from llmz.data import read_tokens, token_count, write_tokens
from llmz.errors import LlmzError, UsageError
from llmz.files import HEADER_BYTES, HEADER_INTS
from llmz.run.launch import RankInfo
from llmz.run.lock import Lock
from llmz.run.model_file import load_model, model_config
from llmz.run.state import (
    DONE_FILE,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    prune,
    read_state,
    step_dir,
)
from llmz.tokenizer import read_tokenizer, write_tokenizer
from mpirun import REPO, cpu_cores, find_mpiexec, mpiexec_command, mpiexec_version, run_mpi

HERE = RankInfo(0, 1, 0, 1, "here")
TINY = ["--device", "cpu", "--model", "tiny", "-b", "2", "-t", "8", "--val-batches", "1", "--sample-tokens", "4",
        "--quiet"]


def args_of(*flags, base=TINY):
    from llmz.train import parse_args
    return parse_args([*base, *map(str, flags)], kind="cpu")[0]


def train_here(*flags, base=TINY) -> dict:
    from llmz.run.loop import train
    return train(args_of(*flags, base=base), "cpu", HERE)


def one_line(e, start: str = "") -> str:
    msg = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in msg and msg.startswith(start), msg
    return msg


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail the test instead of hanging when the block outlasts `seconds` (a blocking open or read)."""
    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s: blocked?")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(*argv, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=timeout)


# ---- readers: non-regular files, oversized headers ---------------------------------------------------------
READERS = {"model": load_model, "model header": model_config, "tokens": read_tokens, "token count": token_count,
           "tokenizer": read_tokenizer, "state": read_state}


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_a_fifo_a_device_or_a_folder_at_once_naming_it(tmp_path, reader, kind):
    path = {"fifo": tmp_path / "fifo", "device": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    with deadline(5), pytest.raises(LlmzError) as e:
        READERS[reader](str(path))
    msg = one_line(e, str(path))
    assert ("is a folder" if kind == "folder" else "not a regular file") in msg


@pytest.mark.parametrize("flag", ["--init-from", "--train-data", "--val-data", "--tokenizer"])
def test_a_fifo_named_by_a_flag_is_refused_at_start_without_blocking(tmp_path, flag):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with deadline(5), pytest.raises(UsageError) as e:
        args_of(flag, fifo)
    assert "FIFO, not a regular file" in one_line(e)


def test_a_fifo_as_a_ranks_state_file_is_refused_without_blocking(tmp_path):
    ck = tmp_path / "ck"
    train_here("--steps", 1, "--checkpoint-dir", ck)
    state = Path(step_dir(ck, 1)) / "state_rank0.bin"
    state.unlink()
    os.mkfifo(state)
    with deadline(10), pytest.raises(LlmzError) as e:
        train_here("--steps", 2, "--resume", step_dir(ck, 1))
    assert "FIFO, not a regular file" in one_line(e, str(state))


@pytest.fixture
def little_memory(monkeypatch):
    """The machine has 64 MiB to spare: a payload larger than that is refused before it is read."""
    monkeypatch.setattr(llmz.files, "available_memory", lambda: 64 << 20)


def sparse(path: Path, header: np.ndarray, size: int) -> None:
    """A file of `size` bytes, the header first and zeros after, which takes no disk space (truncate)."""
    with open(path, "wb") as f:
        f.write(header.tobytes())
    os.truncate(path, size)


def test_huge_sparse_files_are_refused_before_their_payload_is_read(tmp_path, little_memory):
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # a token file of 2^31 - 1 tokens (4 GiB, sparse): its count is read at once, its tokens refused
    h = np.zeros(HEADER_INTS, "<i4")
    n = 2**31 - 1
    h[:3] = 20240520, 1, n
    sparse(tmp_path / "tokens.bin", h, 1024 + 2 * n)
    assert token_count(str(tmp_path / "tokens.bin")) == n
    with deadline(5), pytest.raises(LlmzError) as e:
        read_tokens(str(tmp_path / "tokens.bin"))
    assert "needs 4.00 GiB of memory" in one_line(e, str(tmp_path / "tokens.bin"))
    # a model file of about a billion fp32 parameters: the header loads, the parameters are refused
    cfg = preset("d24", vocab_size=50257)
    h[:8] = 20240326, 3, cfg.max_seq_len, cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.channels, \
        cfg.padded_vocab_size
    sparse(tmp_path / "model.bin", h, 1024 + 4 * cfg.num_parameters())
    assert model_config(str(tmp_path / "model.bin")) == cfg
    with deadline(5), pytest.raises(LlmzError) as e:
        load_model(str(tmp_path / "model.bin"))
    one_line(e, str(tmp_path / "model.bin"))
    # llmz.sample on it: refused at start, one line, status 2
    from llmz.sample import main
    with deadline(20):
        assert main(["--init-from", str(tmp_path / "model.bin"), "--device", "cpu", "--tokens", "1"]) == 2
    # a tokenizer header announcing 2^31 tokens in a 2 KiB file, a state header announcing 2 GiB of JSON
    u = np.zeros(HEADER_INTS, "<u4")
    u[:4] = 20240328, 2, 2**31, 0
    sparse(tmp_path / "tok.bin", u, 2048)
    with pytest.raises(LlmzError, match="cannot hold the 2147483648 tokens"):
        read_tokenizer(str(tmp_path / "tok.bin"))
    u[:4] = 20261203, 1, 2**31, 0
    sparse(tmp_path / "state.bin", u, 4096)
    with pytest.raises(LlmzError, match="end inside the 2147483648-byte JSON section"):
        read_state(str(tmp_path / "state.bin"))
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before      # KiB on Linux
    assert grew < 200 * 1024, f"peak memory grew by {grew} KiB"


# ---- nothing non-finite is saved; a diverging run stops --------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("bad", [np.nan, -np.inf, None])
def test_the_finite_check_sees_one_non_finite_value_anywhere(kdev, rng, dtype, bad):
    """The one reduction behind every save (llmz.kernels.norm's sum of squares, float64): non-finite exactly
    when a value is, in float32 and bf16 (uint16 bits), on the kernel device (simulator here, GPU there)."""
    from llmz.bf16 import f32_to_bf16
    from llmz.kernels.norm import NORM_BLOCKS, norm_squared
    x = (rng.normal(size=701) * 1e3).astype(np.float32)
    x[:8] = 3.0e38                                   # float32's edge: its square still fits a float64
    if bad is not None:
        x[rng.integers(x.size)] = bad
    host = f32_to_bf16(x) if dtype == np.uint16 else x
    out, scratch = kdev.zeros(1, np.float64), kdev.zeros(NORM_BLOCKS, np.float64)
    norm_squared(kdev, out, kdev.asarray(host), scratch)
    assert np.isfinite(kdev.to_host(out)[0]) == (bad is None)


@pytest.mark.parametrize("precision, where", [("fp32", "params"), ("fp64", "m"), ("bf16", "master"),
                                              ("fp32", "v")])
def test_a_checkpoint_or_save_is_never_written_from_non_finite_values(tmp_path, precision, where):
    from llmz.run.loop import Run
    args = args_of("--precision", precision, "--steps", 2, "--zero-stage", 1)
    run = Run(args, "cpu", HERE)
    run.step(0)
    assert run.guards.all_finite()
    buf = {**run.zero.param_store.buffers(), **run.zero.optimizer.buffers()}[where]
    host = run.dev.to_host(buf).copy()
    host[len(host) // 3] = 0xFF80 if host.dtype == np.uint16 else np.nan     # bf16 -inf, or NaN
    run.dev.copy_from_host(buf, host)
    assert not run.guards.all_finite()
    with pytest.raises(LlmzError) as e:
        run.checkpoints.save(str(tmp_path / "ck"), 1)
    assert "non-finite" in one_line(e, "step 0:")
    assert not (tmp_path / "ck").exists() or not checkpoints(str(tmp_path / "ck"))
    with pytest.raises(LlmzError):
        run.checkpoints.save_model(str(tmp_path / "m.bin"), 1)
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("precision, stage", [("fp32", 0), ("bf16", 0), ("bf16", 2)])
def test_on_the_gpu_a_checkpoint_is_never_written_from_non_finite_values(tmp_path, precision, stage):
    """The same on the GPU, after steps replayed as CUDA graphs (stage 0) or eager (stage 2): the check reads
    the buffers the graphs write."""
    from llmz.run.loop import Run
    from llmz.train import parse_args
    args, kind = parse_args(["--device", "gpu", "--model", "d2", "-b", "4", "-t", "64", "--steps", "3",
                             "--precision", precision, "--zero-stage", str(stage), "--quiet"])
    run = Run(args, kind, HERE)
    for step in range(2):
        run.step(step)
    assert run.guards.all_finite()
    assert Path(run.checkpoints.save(str(tmp_path / "ck"), 2), DONE_FILE).exists()
    host = run.dev.to_host(run.zero.param_store.params).copy()
    host[len(host) // 2] = 0x7FC0 if host.dtype == np.uint16 else np.nan
    run.dev.copy_from_host(run.zero.param_store.params, host)
    assert not run.guards.all_finite()
    with pytest.raises(LlmzError, match="non-finite"):
        run.checkpoints.save(str(tmp_path / "ck"), 3)
    assert [s for s, _, done in checkpoints(str(tmp_path / "ck")) if done] == [2]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")         # numpy's overflow warnings: the run diverges
def test_a_diverging_run_stops_naming_the_step_and_keeps_no_checkpoint_of_the_bad_parameters(tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    with pytest.raises(LlmzError) as e:
        train_here("--lr", 1e6, "--warmup-steps", 0, "--steps", 6, "--checkpoint-dir", ck, "--checkpoint-every", 1,
                   "--save", tmp_path / "m.bin", "--log", log)
    msg = one_line(e, "step 1: ")
    assert "diverged" in msg or "non-finite" in msg
    assert "marked incomplete" in msg and "last good checkpoint: none" in msg
    assert [done for _, _, done in checkpoints(str(ck))] == [False]     # step_000001 holds the bad parameters
    assert not (tmp_path / "m.bin").exists()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert recs[-1]["event"] == "stopped" and recs[-1]["step"] == 1


def test_the_divergence_bound_is_three_times_a_uniform_guess_or_max_loss():
    from llmz.run.loop import Run
    run = Run(args_of("--steps", 1), "cpu", HERE)
    assert run.guards.max_loss == pytest.approx(3 * np.log(256))
    assert run.guards.diverged(4, 16.0) is None and "step 4: loss 17" in run.guards.diverged(4, 17.0)
    assert "non-finite" in run.guards.diverged(4, 1.0, float("inf"))
    bounded = Run(args_of("--steps", 1, "--max-loss", 2.5), "cpu", HERE)
    assert bounded.guards.diverged(0, 3.0).endswith("the run diverged")


def test_the_train_command_stops_a_divergence_in_one_line_without_warnings(tmp_path):
    p = run_cli("-m", "llmz.train", *TINY, "--lr", "1e6", "--warmup-steps", "0", "--steps", "5",
                "--log", tmp_path / "run.jsonl")
    assert p.returncode == 1
    assert p.stderr.strip().startswith("error: step 1: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr


# ---- late failures lose nothing ------------------------------------------------------------------------------
def test_a_model_wider_than_its_tokenizer_trains_saves_and_samples_among_the_tokenizers_tokens(tmp_path, capsys):
    train_here("--vocab-size", 50257, "--steps", 2, "--save", tmp_path / "m.bin", "--log", tmp_path / "l.jsonl")
    out = capsys.readouterr().out
    assert "samples are drawn among the tokenizer's 256 only" in out and "--- sample ---" in out
    assert model_config(str(tmp_path / "m.bin")).vocab_size == 50257
    assert '"event": "end"' in (tmp_path / "l.jsonl").read_text()


def test_a_failure_after_the_last_step_costs_neither_model_nor_log_nor_checkpoint(tmp_path, monkeypatch):
    from llmz.run.loop import Sampler

    def broken(self, params):
        raise RuntimeError("the sample failed")
    monkeypatch.setattr(Sampler, "text", broken)
    with pytest.raises(RuntimeError):
        train_here("--steps", 2, "--save", tmp_path / "m.bin", "--log", tmp_path / "l.jsonl", "--checkpoint-dir",
                   tmp_path / "ck")
    load_model(str(tmp_path / "m.bin"))
    recs = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert recs[-1]["event"] == "end" and not list(tmp_path.glob("*.tmp"))
    assert load_checkpoint(latest_checkpoint(str(tmp_path / "ck"))).step == 2
    assert not (tmp_path / "ck" / "llmz.lock").exists() and not (tmp_path / "l.jsonl.lock").exists()


def test_decode_only_and_smaller_tokenizer_files_train_and_sample_without_a_prompt(tmp_path, capsys):
    table = [bytes([i]) for i in range(256)]
    table[65], table[66] = b"AB", b"xyz"                       # not the byte vocabulary: decodes only
    write_tokenizer(str(tmp_path / "dec.bin"), table, 10)
    write_tokenizer(str(tmp_path / "small.bin"), [bytes([i]) for i in range(200)], None)
    train_here("--tokenizer", tmp_path / "dec.bin", "--steps", 1, "--save", tmp_path / "m.bin")
    train_here("--tokenizer", tmp_path / "small.bin", "--vocab-size", 256, "--steps", 1)
    assert capsys.readouterr().out.count("--- sample ---") == 2
    from llmz.sample import main
    assert main(["--init-from", str(tmp_path / "m.bin"), "--tokenizer", str(tmp_path / "dec.bin"), "--tokens", "5",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["--init-from", str(tmp_path / "m.bin"), "--tokenizer", str(tmp_path / "dec.bin"), "--prompt",
                 "hi", "--device", "cpu"]) == 2
    assert "can only decode" in capsys.readouterr().err


def test_a_model_with_a_nan_or_inf_anywhere_and_a_start_token_beyond_the_model_are_refused_in_one_line(
        tmp_path, capsys, rng):
    train_here("--steps", 1, "--save", tmp_path / "m.bin")
    raw = (tmp_path / "m.bin").read_bytes()
    n = (len(raw) - HEADER_BYTES) // 4                          # a float32 model: one value at a random place
    from llmz.sample import main
    for bad in (np.nan, np.inf):
        i = HEADER_BYTES + 4 * int(rng.integers(n))
        (tmp_path / "bad.bin").write_bytes(raw[:i] + np.float32(bad).tobytes() + raw[i + 4:])
        with pytest.raises(LlmzError) as e:
            load_model(str(tmp_path / "bad.bin"))
        assert f"1 of {n:,} parameters are NaN or infinite" in one_line(e)
        capsys.readouterr()
        assert main(["--init-from", str(tmp_path / "bad.bin"), "--tokens", "3", "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and "NaN or infinite" in err[0], err
    # a sample without a prompt starts from the tokenizer's end-of-text: beyond the model's 256 tokens here
    table = [bytes([i]) for i in range(256)] + [b"<%d>" % i for i in range(256, 300)]
    write_tokenizer(str(tmp_path / "big.bin"), table, 299)
    assert main(["--init-from", str(tmp_path / "m.bin"), "--tokenizer", str(tmp_path / "big.bin"), "--tokens", "3",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "token 299" in err[0] and "vocabulary of 256" in err[0], err


def test_a_file_found_wrong_while_setting_up_is_refused_with_status_2_in_one_line(tmp_path):
    # token ids beyond the model's 256: found when the data is read, before any step (as a bad flag: status 2)
    write_tokens(str(tmp_path / "t.bin"), (np.arange(4000) % 300).astype(np.uint16))
    p = run_cli("-m", "llmz.train", *TINY, "--train-data", tmp_path / "t.bin", "--steps", 1)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: ") and "is >= vocab size 256" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "step" not in p.stdout, (p.stdout, p.stderr)


# ---- the log ----------------------------------------------------------------------------------------------------
def test_the_log_has_its_name_from_the_first_step_and_a_resume_replaces_what_the_failed_attempt_wrote_after(
        tmp_path, monkeypatch):
    from llmz.trainer import Trainer
    real_step = Trainer.step
    log, ck = tmp_path / "run.jsonl", tmp_path / "ck"
    flags = ["--precision", "fp64", "--steps", 6, "--checkpoint-dir", ck, "--checkpoint-every", 3, "--log", log,
             "--val-every", 2]

    def interrupted_at_4(self, step):
        if step == 4:
            assert log.exists() and not Path(str(log) + ".tmp").exists()
            raise KeyboardInterrupt
        return real_step(self, step)
    monkeypatch.setattr(Trainer, "step", interrupted_at_4)
    with pytest.raises(KeyboardInterrupt) as e:
        train_here(*flags)
    assert str(e.value) == f"interrupted at step 4; last checkpoint {step_dir(ck, 3)}; log {log}"
    first = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in first if "loss" in r] == [0, 1, 2, 3]
    monkeypatch.undo()
    train_here(*flags, "--resume")
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 2, 4, 5]
    assert [r.get("event") for r in recs if "event" in r] == ["start", "checkpoint", "start", "checkpoint", "end"]
    # step 3 again, from the checkpoint after step 3 updates: the same bits as the first attempt's
    second = recs[[i for i, r in enumerate(recs) if r.get("event") == "start"][1]:]
    assert next(r["loss"] for r in second if r.get("step") == 3 and "loss" in r) == \
        next(r["loss"] for r in first if r.get("step") == 3 and "loss" in r)


# ---- --keep and the checkpoint folder ---------------------------------------------------------------------------
def test_keep_deletes_only_checkpoints_older_than_the_one_just_written(tmp_path):
    for s in range(1, 11):
        os.makedirs(step_dir(tmp_path, s))
        if s != 4:
            Path(step_dir(tmp_path, s), DONE_FILE).write_text("{}")
    deleted = prune(str(tmp_path), keep=2, newest=6)
    assert sorted(Path(p).name for p in deleted) == ["step_000001", "step_000002", "step_000003", "step_000004"]
    assert [s for s, _, _ in checkpoints(str(tmp_path))] == [5, 6, 7, 8, 9, 10]


def test_resume_with_keep_never_deletes_what_a_later_resume_needs(tmp_path):
    ck = tmp_path / "ck"
    train_here("--steps", 6, "--checkpoint-dir", ck, "--checkpoint-every", 1)
    # resuming from step 3 into the folder that holds 4..6 of the run that went on: refused, nothing deleted
    with pytest.raises(UsageError) as e:
        args_of("--steps", 8, "--resume", step_dir(ck, 3), "--checkpoint-dir", ck, "--keep", 1)
    assert "holds complete checkpoints past step 3 (up to step 6)" in one_line(e)
    assert [s for s, _, done in checkpoints(str(ck)) if done] == [1, 2, 3, 4, 5, 6]
    # a fresh run into it: refused the same way
    with pytest.raises(UsageError, match="starting afresh"):
        args_of("--steps", 2, "--checkpoint-dir", ck)
    # continuing the newest with --keep 2: only older ones go
    train_here("--steps", 8, "--resume", "--checkpoint-dir", ck, "--checkpoint-every", 1, "--keep", 2)
    assert [s for s, _, done in checkpoints(str(ck)) if done] == [7, 8]


# ---- locks: one live run per checkpoint folder and per log ---------------------------------------------------
@pytest.mark.parametrize("what", ["checkpoint-dir", "log"])
def test_a_checkpoint_folder_or_log_in_use_is_refused_and_a_stale_lock_is_taken_over_with_a_note(
        tmp_path, capsys, what):
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    os.makedirs(ck)
    path = ck / "llmz.lock" if what == "checkpoint-dir" else Path(str(log) + ".lock")
    flags = ["--steps", 1, "--checkpoint-dir", ck, "--log", log]
    live = Lock(str(path), "it")
    assert live.acquire() is None                                   # a live owner: this very process
    with pytest.raises(LlmzError) as e:             # refused at start, on every rank alike: exit status 2
        train_here(*flags)
    assert f"is in use by another run (pid {os.getpid()} on " in one_line(e) and e.value.exit_code == 2
    live.release()
    # a dead owner on this host: taken over, with a note
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 0, "tick": 1}))
    train_here(*flags)
    assert f"was locked by pid {dead.pid}" in capsys.readouterr().out and not path.exists()
    # another host's lock cannot be checked from here: refused, with how to clear it
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
    with pytest.raises(LlmzError, match=f"if it does not, delete {path}"):
        train_here("--steps", 2, "--resume", "--checkpoint-dir", ck, "--log", log)


def test_two_train_commands_on_one_checkpoint_folder_the_second_is_refused(tmp_path):
    ck = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-m", "llmz.train", *TINY, "--steps", "100000", "--checkpoint-dir",
                              str(ck)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not (ck / "llmz.lock").exists() and time.time() - t0 < 60 and first.poll() is None:
            time.sleep(0.1)
        p = run_cli("-m", "llmz.train", *TINY, "--steps", "2", "--checkpoint-dir", ck)
        assert p.returncode == 2 and "is in use by another run" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    finally:
        first.kill()
        first.communicate()


# ---- Ctrl-C -------------------------------------------------------------------------------------------------------
def interrupt(cmd: list, ready, timeout: float = 90, sig=signal.SIGINT) -> subprocess.CompletedProcess:
    """Start `cmd`, wait until ready() is true, send `sig` (SIGINT: Ctrl-C), return the finished process."""
    p = subprocess.Popen([sys.executable, *map(str, cmd)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while not ready() and time.time() - t0 < timeout and p.poll() is None:
            time.sleep(0.1)
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_ctrl_c_is_one_line_from_train_and_sample(tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    p = interrupt(["-m", "llmz.train", *TINY, "--steps", "100000", "--checkpoint-dir", ck, "--checkpoint-every",
                   "20", "--log", log], lambda: log.exists() and '"event": "checkpoint"' in log.read_text())
    assert p.returncode == 130, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("interrupted at step "), p.stderr
    assert f"last checkpoint {latest_checkpoint(str(ck))}; log {log}" in p.stderr
    model = Path(latest_checkpoint(str(ck))) / "model.bin"
    t0 = time.time()
    p = interrupt(["-m", "llmz.sample", "--init-from", model, "--tokens", "100000", "--device", "cpu"],
                  lambda: time.time() - t0 > 8)
    window, *rest = [line for line in p.stderr.splitlines() if line]     # the sample's first line, then Ctrl-C's
    assert window.startswith("note: sampling with a window of T=")
    assert p.returncode == 130 and len(rest) == 1 and rest[0].startswith("interrupted after "), p.stderr


# ---- ranks -------------------------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("rank1, expect", [(["--lr", "nan"], "error: rank 1: --lr nan: must be a finite number"),
                                           (["--model", "thin"], ("error: the ranks disagree: rank 1 has --model "
                                                                  "'thin', rank 0 --model 'tiny'"))])
def test_a_bad_flag_on_one_rank_ends_the_mpi_job_at_once_in_one_line(rank1, expect):
    cmd = ["-m", "llmz.train", *TINY, "--steps", "2"]
    t0 = time.time()
    p = run_mpi(1, [*cmd, ":", "-n", "1", sys.executable, *cmd, *rank1], timeout=60)
    took = time.time() - t0
    print(f"mpiexec -n 1 ... : -n 1 ... {' '.join(rank1)}: exit {p.returncode} after {took:.1f} s")
    assert p.returncode == 2 and p.stderr.strip().startswith(expect) and p.stderr.count("\n") == 1, p.stderr
    assert took < 30


# ---- small things: outputs and lines ---------------------------------------------------------------------------------
def test_no_sample_block_with_sample_tokens_0_and_one_step_reports_its_time(capsys):
    train_here("--steps", 1, "--sample-tokens", 0, "--sample-every", 1)
    out = capsys.readouterr().out
    assert "sample" not in out and "---" not in out
    ms = float(out.split("; ")[-2].split(" ms/step")[0])
    assert ms > 0 and "(one step, with warm-up)" in out


def test_step_lines_and_log_records_carry_elapsed_time_and_eta(tmp_path, capsys):
    train_here("--steps", 3, "--log", tmp_path / "l.jsonl", base=[a for a in TINY if a != "--quiet"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "loss " in line
             and "val" not in line]
    assert len(lines) == 3 and all("elapsed, ETA " in line and "tok/s" in line for line in lines), lines
    recs = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines() if '"loss"' in line]
    assert all(r["elapsed_s"] > 0 and r["eta_s"] >= 0 for r in recs) and recs[-1]["eta_s"] == 0


def test_resume_with_other_training_data_says_so(tmp_path, capsys):
    from llmz.config import DEFAULT_DATA
    ck = tmp_path / "ck"
    train_here("--steps", 1, "--checkpoint-dir", ck)
    other = tmp_path / "other.bin"          # as many tokens as the shipped data, other ones
    write_tokens(str(other), np.random.default_rng(1).integers(0, 256, token_count(
        os.path.join(DEFAULT_DATA, "shakespeare_train.bin"))))
    train_here("--steps", 2, "--resume", "--checkpoint-dir", ck, "--train-data", other)
    out = capsys.readouterr().out
    assert "changed: " in out and f"--train-data {other} (was " in out


def test_resume_with_a_data_file_rewritten_under_its_name_is_refused_naming_both_digests(tmp_path, capsys):
    import hashlib
    data, ck, log = tmp_path / "t.bin", tmp_path / "ck", tmp_path / "run.jsonl"
    write_tokens(str(data), np.random.default_rng(1).integers(0, 256, 5000))
    then = hashlib.sha256(data.read_bytes()).hexdigest()
    train_here("--steps", 1, "--train-data", data, "--checkpoint-dir", ck, "--log", log)
    write_tokens(str(data), np.random.default_rng(2).integers(0, 256, 5000))     # other text, the same count
    now = hashlib.sha256(data.read_bytes()).hexdigest()
    written = log.read_text()
    with pytest.raises(LlmzError) as e:
        train_here("--steps", 2, "--train-data", data, "--resume", "--checkpoint-dir", ck, "--log", log)
    assert one_line(e) == (f"--train-data {data} is not the file checkpoint {step_dir(ck, 1)} was trained on: "
                           f"sha256 {now[:16]} now (11,024 bytes), {then[:16]} then (11,024 bytes); the run would go "
                           f"on at its position in other data: restore the file, or add --resume-other-data to go on "
                           f"anyway")
    assert e.value.exit_code == 2 and log.read_text() == written         # refused before any work
    capsys.readouterr()
    train_here("--steps", 2, "--train-data", data, "--resume", "--checkpoint-dir", ck, "--log", log,
               "--resume-other-data")
    assert "going on, as --resume-other-data says" in capsys.readouterr().out
    start = [json.loads(line) for line in log.read_text().splitlines() if '"event": "start"' in line][-1]
    assert any("going on, as --resume-other-data says" in n for n in start["notes"])       # said in the log
    assert start["data"]["--train-data"] == [[str(data), 11024, now]]
    assert load_checkpoint(step_dir(ck, 2)).meta["data_files"]["--train-data"] == [[str(data), 11024, now]]


# ---- the same file under another name; a --log that is not a log; another run's checkpoint -------------------
def test_a_log_or_checkpoint_folder_in_use_is_refused_under_any_name(tmp_path):
    from llmz.run.outputs import JsonLog
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    os.makedirs(ck)
    live = JsonLog(str(log))                     # what a live run holds: its log open (and locked) ...
    live.write({"event": "start"})
    lock = Lock(str(ck / "llmz.lock"), "it")     # ... and its folder's lock
    lock.acquire()
    os.symlink(log, tmp_path / "alias.jsonl")
    os.link(log, tmp_path / "hard.jsonl")
    os.symlink(ck, tmp_path / "ckalias")
    try:
        for name in ("alias.jsonl", "hard.jsonl", "./run.jsonl"):
            with pytest.raises(LlmzError) as e:         # refused at start, on every rank alike: status 2
                train_here("--steps", 1, "--log", f"{tmp_path}/{name}")
            assert "is in use by another run" in one_line(e) and e.value.exit_code == 2, name
        for folder in (tmp_path / "ckalias", f"{ck}/../ck"):
            with pytest.raises(LlmzError, match="is in use by another run"):
                train_here("--steps", 1, "--checkpoint-dir", folder)
        assert log.read_text() == '{"event": "start"}\n'        # nothing truncated, nothing appended
    finally:
        live.close()
        lock.release()
    train_here("--steps", 1, "--log", tmp_path / "hard.jsonl")  # the run ended: the same names are free
    assert '"event": "end"' in log.read_text()


def test_a_log_that_is_not_an_llmz_log_is_refused_and_left_as_it_is(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nline 2\n")
    for flags in ([], ["--resume", "--checkpoint-dir", tmp_path / "ck"]):
        with pytest.raises(LlmzError) as e:
            train_here("--steps", 1, "--log", notes, *flags)
        assert "not an llmz log (line 1, 'my notes', is not a start record)" in one_line(e)
    log = tmp_path / "run.jsonl"                 # a log with a note typed into it: a resume would trim it
    train_here("--steps", 2, "--log", log, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 1)
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:2] + ["my note"] + lines[2:]) + "\n")
    with pytest.raises(LlmzError, match="line 3, 'my note', is not a JSON record"):
        train_here("--steps", 3, "--log", log, "--resume", step_dir(tmp_path / "ck", 1), "--checkpoint-dir",
                   tmp_path / "ck2")
    assert notes.read_text() == "my notes\nline 2\n" and "my note\n" in log.read_text()


def test_a_checkpoint_of_another_run_is_named_and_refused_unless_the_user_says_so(tmp_path, capsys):
    ck, other = tmp_path / "ck", tmp_path / "other"
    train_here("--steps", 2, "--checkpoint-dir", ck, "--log", tmp_path / "run.jsonl")
    train_here("--steps", 4, "--checkpoint-dir", other, "--seed", 7)
    shutil.copytree(step_dir(other, 4), step_dir(ck, 4))                 # copied in beside this run's
    mine, theirs = (json.loads(Path(step_dir(d, s), DONE_FILE).read_text())["run_id"] for d, s in ((ck, 2), (other, 4)))
    assert mine != theirs and load_checkpoint(step_dir(ck, 4)).meta["run_id"] == theirs
    with pytest.raises(LlmzError) as e:
        train_here("--steps", 6, "--resume", "--checkpoint-dir", ck)
    assert one_line(e) == (f"--resume {step_dir(ck, 4)} is a checkpoint of run {theirs}, but checkpoint "
                           f"{step_dir(ck, 2)} belongs to run {mine} (a checkpoint copied from another run?); to "
                           f"continue run {theirs} there anyway, add --resume-other-run")
    # --resume-other-run takes it, but never trims this run's log (only the run that wrote a log may): refused
    log = tmp_path / "run.jsonl"
    written = log.read_text()
    with pytest.raises(LlmzError) as e:
        train_here("--steps", 6, "--resume", "--checkpoint-dir", ck, "--log", log, "--resume-other-run")
    assert f"--resume-other-run takes it, but --log {log} is the log of run {mine}, which only that run may " \
        f"trim: name a new --log for run {theirs}" in one_line(e)
    capsys.readouterr()
    train_here("--steps", 6, "--resume", "--checkpoint-dir", ck, "--log", tmp_path / "new.jsonl", "--resume-other-run")
    assert "continuing it, as --resume-other-run says" in capsys.readouterr().out
    assert json.loads(Path(step_dir(ck, 6), DONE_FILE).read_text())["run_id"] == theirs      # its run goes on
    shutil.rmtree(step_dir(ck, 2))              # the folder alone no longer tells, the log still does
    for flags in ([], ["--resume-other-run"]):
        with pytest.raises(LlmzError) as e:
            train_here("--steps", 8, "--resume", "--checkpoint-dir", ck, "--log", log, *flags)
        assert one_line(e) == (f"--log {log} is the log of run {mine}, and --resume {step_dir(ck, 6)} continues run "
                               f"{theirs}: a resume trims its log back to the step it resumes from, which only the "
                               f"run that wrote the log may do; name a new --log for run {theirs}")
    assert log.read_text() == written                                   # another run's log: left whole


@pytest.mark.mpi
def test_state_files_of_two_runs_are_refused_in_one_line_not_one_per_rank(tmp_path):
    cmd = ["-m", "llmz.train", *TINY, "--steps", "2"]
    for folder, seed in (("ck", "1"), ("ckB", "2")):
        assert run_mpi(2, [*cmd, "--checkpoint-dir", str(tmp_path / folder), "--seed", seed]).returncode == 0
    shutil.copy(tmp_path / "ckB" / "step_000002" / "state_rank1.bin", tmp_path / "ck" / "step_000002")
    p = run_mpi(2, [*cmd[:-1], "4", "--checkpoint-dir", str(tmp_path / "ck"), "--resume"], timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: {tmp_path}/ck/step_000002/state_rank1.bin: of another run (run id "), p.stderr


@pytest.mark.mpi
def test_ranks_that_read_different_data_are_refused_before_any_work_naming_the_rank_and_file(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):        # the same relative name, two folders, other tokens
        (tmp_path / name).mkdir()
        write_tokens(str(tmp_path / name / "t.bin"), np.random.default_rng(seed).integers(0, 256, 5000))
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    full = mpiexec_command(mpiexec, 2, [], mpiexec_version(mpiexec), os.geteuid() == 0, cpu_cores())
    rank = ["-n", "1", sys.executable, "-m", "llmz.train", *TINY, "--steps", "2", "--train-data", "t.bin"]
    p = subprocess.run([*full[:full.index("-n")], "-wdir", str(tmp_path / "a"), *rank, ":", "-wdir",
                        str(tmp_path / "b"), *rank], capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "step" not in p.stdout, p.stderr
    assert p.stderr.startswith("error: rank 1's --train-data file t.bin (11024 bytes, sha256 "), p.stderr
    assert "differs from rank 0's t.bin (11024 bytes, sha256 " in p.stderr


# ---- odd inputs: prompt bytes, token counts, names at the filesystem's limits -----------------------------------
def test_any_bytes_of_a_prompt_encode_and_a_lone_surrogate_or_too_many_tokens_are_refused(tmp_path, capsys):
    from llmz.sample import MAX_TOKENS, main
    from llmz.tokenizer import ByteTokenizer
    train_here("--steps", 1, "--save", tmp_path / "m.bin")
    raw = bytes(range(256))                                     # every byte, as a command line brings them
    assert ByteTokenizer().encode(os.fsdecode(raw)).tolist() == list(raw)
    base = ["--init-from", str(tmp_path / "m.bin"), "--device", "cpu"]
    assert main([*base, "--prompt", os.fsdecode(b"ab\xff\xfe"), "--tokens", "3"]) == 0
    capsys.readouterr()
    for argv, expect in [(["--prompt", "a\ud800"], "--prompt: character U+D800 at position 1 is a lone surrogate"),
                         (["--tokens", str(MAX_TOKENS + 1)], f"--tokens {MAX_TOKENS + 1}: must be at most 1,000,000"),
                         (["--tokens", str(2**63)], f"--tokens {2**63}: must be at most 1,000,000")]:
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {expect}") and err.count("\n") == 1, err


def test_names_that_fit_the_filesystem_work_and_names_that_cannot_are_refused_at_start(tmp_path):
    from llmz.files import name_limits
    name_max, path_max = name_limits(str(tmp_path))
    fits = "m" * (name_max - 4) + ".bin"                        # the longest name: its temporary name is cut
    train_here("--steps", 1, "--save", tmp_path / fits, "--log", tmp_path / (fits[:-4] + ".log"),
               "--checkpoint-dir", tmp_path / ("c" * name_max))
    assert (tmp_path / fits).is_file() and load_checkpoint(latest_checkpoint(str(tmp_path / ("c" * name_max))))
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.lock"))
    for flag, path, expect in [("--save", tmp_path / ("m" * name_max + "x"), f"bytes long; this filesystem allows {name_max}"),
                               ("--log", tmp_path / ("x" * 300) / "run.jsonl", f"this filesystem allows {name_max}"),
                               ("--checkpoint-dir", tmp_path.joinpath(*["c" * 200] * (path_max // 200)), "is too long")]:
        with pytest.raises(UsageError) as e:
            args_of("--steps", 1, flag, path)
        assert one_line(e).startswith(f"{flag}: ") and expect in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["c" * name_max]     # nothing made


def test_a_lock_left_by_a_zombie_is_taken_over_at_once(tmp_path, capsys):
    from llmz.run.environment import process_state
    dead = subprocess.Popen([sys.executable, "-c", "pass"])      # exits; not reaped: a zombie holds its pid
    while process_state(dead.pid)[0] != "Z":
        time.sleep(0.01)
    lock = tmp_path / "run.jsonl.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 0,
                                "tick": process_state(dead.pid)[1]}))
    train_here("--steps", 1, "--log", tmp_path / "run.jsonl")
    assert f"was locked by pid {dead.pid}" in capsys.readouterr().out
    dead.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_end_a_run_in_one_line_with_the_step_and_the_last_checkpoint(tmp_path, sig):
    ck, log = tmp_path / "ck", tmp_path / "run.jsonl"
    p = interrupt(["-m", "llmz.train", *TINY, "--steps", "100000", "--checkpoint-dir", ck, "--checkpoint-every",
                   "20", "--log", log], lambda: log.exists() and '"event": "checkpoint"' in log.read_text(), sig=sig)
    assert p.returncode == 128 + sig, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"terminated by {sig.name} at step "), p.stderr
    assert f"last checkpoint {latest_checkpoint(str(ck))}; log {log}" in p.stderr
    # nohup: an ignored SIGHUP stays ignored
    code = ("import signal, os; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
            "from llmz.run.launch import abort_on_error\nwith abort_on_error():\n    os.kill(os.getpid(), signal.SIGHUP)\n"
            "print('still here')")
    assert run_cli("-c", code).stdout == "still here\n"


@pytest.mark.mpi
def test_mpi_refuses_to_start_under_a_file_size_limit_it_cannot_work_with_in_one_line(tmp_path):
    import resource
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (51200, 51200)); "    # ulimit -f 50
            "from llmz.train import main; sys.exit(main(sys.argv[1:]))")
    p = run_mpi(2, ["-c", code, *TINY, "--steps", "1"], timeout=60)
    assert p.returncode == 2 and p.stderr == ("error: the file-size limit (ulimit -f) is 50.00 KiB: MPI's start-up "
                                              "writes shared-memory files of several MiB and dies under it; raise it "
                                              "(ulimit -f unlimited, or at least 16 MiB)\n"), p.stderr
    # one process needs no MPI: it trains under the same limit (writing no model, which would not fit it)
    assert run_cli("-c", code, *TINY, "--steps", "1", "--no-run-dir").returncode == 0
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] != 51200


def test_a_checkpoint_folder_written_again_drops_what_a_killed_writer_left(tmp_path):
    from llmz.run.state import prepare_step_dir
    folder = tmp_path / "step_000020"
    folder.mkdir()
    for name in ("DONE", "state_rank0.bin", "state_rank1.bin.4f3iiiwp.tmp", "model.bin.x1y2z3w4.tmp", "state_rank3.bin"):
        (folder / name).write_text("earlier attempt")
    prepare_step_dir(str(folder), world_size=2)         # before any rank of this attempt writes there
    assert sorted(p.name for p in folder.iterdir()) == ["state_rank0.bin"]
