"""Checkpoints and resume: N steps + resume + N steps equal 2N straight steps bit for bit (same world size,
stages 0-3, float64 and float32); resume on another world size or ZeRO stage re-shards and continues
within float64 rounding; a killed rank, a failed write or a non-finite loss never costs the last complete
checkpoint; a corrupted checkpoint ends `python -m llmz.train` with one `error:` line."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import llmz.files
import llmz.run.model_file
import llmz.run.state
from llmz.config import GPT2Config
from llmz.errors import LlmzError
from llmz.layout import Layout, init_parameters
from llmz.run.launch import RankInfo
from llmz.run.model_file import load_model, save_model
from llmz.run.state import checkpoints, latest_checkpoint, load_checkpoint, state_path, step_dir
from mpirun import REPO, run_mpi, start_mpi

# C=15 (odd) and maxT=9: buckets of odd size, so their padding differs between 1, 2 and 4 ranks and
# re-sharding must really move elements between ranks. 4 tokens per rank-row x ... see GLOBAL_B.
CFG = GPT2Config(max_seq_len=9, vocab_size=256, padded_vocab_size=256, num_layers=2, num_heads=3, channels=15)
T, S = 8, 3                       # sequence length; steps per segment
GLOBAL_B = 4                      # B x world size, the same in every run: the same tokens every step
FLAGS = ["-m", "llmz.train", "--device", "cpu", "-t", str(T), "--lr", "1e-2", "--warmup-steps", "2",
         "--weight-decay", "0.1", "--grad-clip", "1.0", "--val-every", "2", "--val-batches", "1",
         "--sample-every", "2", "--sample-tokens", "8", "--quiet"]
_cache: dict = {}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "odd.bin"
    lay = Layout(CFG, 1)
    save_model(str(path), CFG, init_parameters(lay, seed=7), lay)
    return str(path)


def train_mpi(n: int, flags: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    p = run_mpi(n, [*FLAGS, "-b", str(GLOBAL_B // n), *flags], timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def steps_of(log: Path) -> dict:
    """step -> (loss, grad_norm) and step -> val loss, from a --log file."""
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    return ({r["step"]: (r["loss"], r["grad_norm"]) for r in recs if "loss" in r},
            {r["step"]: r["val_loss"] for r in recs if "val_loss" in r})


def sample_text(stdout: str) -> str:
    return stdout.split("--- sample ---")[1].split("--------------")[0]


def full(ckpt_folder, name: str) -> np.ndarray:
    """Array `name` of a checkpoint, whole, in the 1-rank layout (for comparing runs of any world size)."""
    ck = load_checkpoint(str(ckpt_folder))
    return ck.assemble(name, llmz.run.state.full_ranges(Layout(ck.config, 1)))


# ---- bit-identical resume ----------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("stage,precision", [(0, "fp64"), (1, "fp64"), (2, "fp64"), (2, "fp32"), (0, "fp32"),
                                             (3, "fp64")])
def test_resume_on_the_same_ranks_is_bit_identical_to_the_straight_run(tmp_path, model_file, stage,
                                                                        precision):
    common = ["--init-from", model_file, "--zero-stage", str(stage), "--precision", precision,
              "--steps", str(2 * S)]
    # straight: 2S steps, a checkpoint after S (written, then training goes on as if it had not been)
    a = train_mpi(2, [*common, "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", str(S),
                      "--log", str(tmp_path / "a.jsonl")])
    # resumed: a new job from the step-S checkpoint, same --steps
    b = run_mpi(2, [*FLAGS, "-b", "2", "--zero-stage", str(stage), "--precision", precision, "--steps",
                    str(2 * S), "--resume", str(step_dir(tmp_path / "a", S)), "--checkpoint-dir",
                    str(tmp_path / "b"), "--log", str(tmp_path / "b.jsonl")], timeout=120)
    assert b.returncode == 0, b.stdout + b.stderr
    assert f"resume: step {S} from" in b.stdout
    (la, va), (lb, vb) = steps_of(tmp_path / "a.jsonl"), steps_of(tmp_path / "b.jsonl")
    # the same step numbers, and the same bits: loss, gradient norm, validation loss
    assert sorted(lb) == list(range(S, 2 * S))
    assert {k: la[k] for k in lb} == lb
    assert vb and {k: va[k] for k in vb} == vb
    assert sample_text(a.stdout) == sample_text(b.stdout)       # the RNG state came back too
    # every rank's final parameters (full precision), m and v: bit for bit
    for r in range(2):
        sa = llmz.run.state.read_state(state_path(step_dir(tmp_path / "a", 2 * S), r))
        sb = llmz.run.state.read_state(state_path(step_dir(tmp_path / "b", 2 * S), r))
        for name in ("params", "m", "v"):
            assert sa.arrays[name].dtype == np.dtype("<f8" if precision == "fp64" else "<f4")
            assert np.array_equal(sa.arrays[name], sb.arrays[name]), (r, name)
        assert sa.meta["data"] == sb.meta["data"]
    # not a vacuous check: training moved the parameters and filled the optimizer state
    assert not np.array_equal(full(step_dir(tmp_path / "a", S), "params"),
                              full(step_dir(tmp_path / "a", 2 * S), "params"))
    assert np.abs(full(step_dir(tmp_path / "a", S), "v")).max() > 0


# ---- re-sharding: another world size, another stage --------------------------------------------------------
def straight_reference(tmp_path_factory, model_file):
    """3S steps on one rank, B=4, stage 0: the run every chain below is compared with."""
    if "straight" not in _cache:
        out = tmp_path_factory.mktemp("straight")
        train_mpi(1, ["--init-from", model_file, "--precision", "fp64", "--steps", str(3 * S),
                      "--checkpoint-dir", str(out / "ck"), "--log", str(out / "log.jsonl")])
        _cache["straight"] = (steps_of(out / "log.jsonl")[0], full(step_dir(out / "ck", 3 * S), "params"),
                              full(step_dir(out / "ck", 3 * S), "v"))
    return _cache["straight"]


@pytest.mark.mpi
@pytest.mark.parametrize("chain", [((2, 2), (4, 1), (1, 0)), ((2, 2), (2, 1), (2, 0)), ((2, 3), (4, 1), (1, 3))],
                         ids=["ranks_2_4_1", "stages_2_1_0", "stage3_ranks_2_4_1"])
def test_resume_across_world_sizes_and_stages_matches_the_straight_run(tmp_path, tmp_path_factory,
                                                                       model_file, chain):
    ref_losses, ref_params, ref_v = straight_reference(tmp_path_factory, model_file)
    losses = {}
    for i, (n, stage) in enumerate(chain):
        # segment i continues from the checkpoint segment i-1 wrote after step i*S (it trains on to 3S too:
        # --steps sets the LR schedule, so every segment keeps --steps 3S; its later steps are not used).
        # B x n = 4 in every segment: each step reads the same 32 tokens, whatever the world size.
        prev = step_dir(tmp_path / f"ck{i - 1}", i * S)
        start = ["--init-from", model_file] if i == 0 else ["--resume", prev]
        train_mpi(n, [*start, "--precision", "fp64", "--zero-stage", str(stage), "--steps", str(3 * S),
                      "--checkpoint-dir", str(tmp_path / f"ck{i}"), "--checkpoint-every", str(S),
                      "--log", str(tmp_path / f"{i}.jsonl")])
        seg = steps_of(tmp_path / f"{i}.jsonl")[0]
        assert sorted(seg) == list(range(i * S, 3 * S))
        losses.update({k: seg[k] for k in range(i * S, (i + 1) * S)})
        # what the segment saved: n state files, each rank's slice of the buckets padded for n ranks
        done = load_checkpoint(step_dir(tmp_path / f"ck{i}", (i + 1) * S))
        assert done.world_size == n and done.meta["zero_stage"] == stage
    ck = tmp_path / f"ck{len(chain) - 1}"
    # float64: the runs differ only in the order of additions (1e-16 each), so 1e-12 is far from any bug
    # (a rank with the wrong slice of m or v, or a shifted data position, changes the loss at 1e-3)
    got = np.array([losses[k] for k in sorted(ref_losses)])              # (loss, grad norm) per step
    want = np.array([ref_losses[k] for k in sorted(ref_losses)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    params, v = full(step_dir(ck, 3 * S), "params"), full(step_dir(ck, 3 * S), "v")
    assert np.linalg.norm(params - ref_params) / np.linalg.norm(ref_params) < 1e-12
    assert np.linalg.norm(v - ref_v) / np.linalg.norm(ref_v) < 1e-10     # v ~ g^2: twice the relative error
    assert got[-1, 0] != got[0, 0]


def test_reassembling_any_world_size_gives_back_the_same_buffers(tmp_path, rng):
    """Checkpoint.assemble on synthetic slices: 3 ranks' slices -> full buffers and shards for 1, 2, 4 ranks,
    padding zero, every real element where it belongs."""
    from llmz.run.state import Checkpoint, TrainingState, full_ranges, shard_table
    saved = Layout(CFG, 3)
    truth = {k: rng.normal(size=Layout(CFG, 1).total) for k in ("params", "m", "v")}
    one = Layout(CFG, 1)

    def slices(layout, rank, flat1):
        """What rank of `layout` holds: its slice of every bucket, real elements from flat1, padding zero."""
        parts = []
        for b, b1 in zip(layout.buckets, one.buckets):
            s, e = layout.shard_range(b, rank)
            piece, hi = np.zeros(e - s), min(e, b.size)
            piece[:max(hi - s, 0)] = flat1[b1.offset + s:b1.offset + hi]
            parts.append(piece)
        return np.concatenate(parts)

    states = [TrainingState("x", {"rank": r, "step": 0, "buckets": shard_table(saved, r)}, saved,
                            {k: slices(saved, r, truth[k]) for k in truth}) for r in range(3)]
    ck = Checkpoint("x", CFG, states)
    for n in (1, 2, 4):
        lay = Layout(CFG, n)
        whole = ck.assemble("m", full_ranges(lay))
        assert np.array_equal(lay.to_llmc(whole), one.to_llmc(truth["m"]))
        pad = np.ones(lay.total, bool)
        for b in lay.buckets:
            pad[b.offset:b.offset + b.size] = False
        assert not whole[pad].any()
        for r in range(n):
            mine = ck.assemble("v", [(b, *lay.shard_range(b, r)) for b in lay.buckets])
            assert np.array_equal(mine, slices(lay, r, truth["v"]))


# ---- failures ----------------------------------------------------------------------------------------------
def rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the `python -m llmz.train` processes descending from `root` (mpiexec), from /proc.
    (Hydra gives every rank a session of its own, so the descendants are found through parent pids.)"""
    parent, info = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            info[int(d.name)] = ((d / "cmdline").read_bytes(), (d / "environ").read_bytes().split(b"\0"))
        except (OSError, IndexError, ValueError):
            continue
    out = {}
    for pid, (cmd, env) in info.items():
        up = pid
        while up in parent and up != root:
            up = parent[up]
        if up == root and b"llmz.train" in cmd:
            for kv in env:
                if kv.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=")):       # mpich's Hydra, Open MPI
                    out[int(kv.split(b"=", 1)[1])] = pid
    return out


@pytest.mark.mpi
def test_kill_9_of_one_rank_ends_the_others_and_keeps_the_last_complete_checkpoint(tmp_path, model_file):
    ck = tmp_path / "ck"
    proc = start_mpi(2, [*FLAGS, "-b", "2", "--init-from", model_file, "--precision", "fp64", "--zero-stage",
                         "2", "--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                         "--keep", "3"])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and max((s for s, _, c in checkpoints(str(ck)) if c), default=0) < 4:
            time.sleep(0.05)
        pids = rank_pids(proc.pid)
        assert len(pids) == 2 and latest_checkpoint(str(ck)), (pids, checkpoints(str(ck)))
        os.kill(pids[1], signal.SIGKILL)            # mid-training, likely mid-checkpoint (one every step)
        t0 = time.time()
        proc.communicate(timeout=30)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    assert took < 30, took
    print(f"killed rank 1 (pid {pids[1]}): mpiexec returned {proc.returncode} after {took:.2f} s")
    latest = latest_checkpoint(str(ck))
    ckpt = load_checkpoint(latest)
    assert ckpt.world_size == 2 and ckpt.step >= 3
    # nothing under a final name is partial: every model.bin and state file anywhere reads whole
    for f in ck.glob("step_*/*"):
        if f.name == "model.bin":
            load_model(str(f))
        elif f.name.startswith("state_rank") and f.name.endswith(".bin"):
            llmz.run.state.read_state(str(f))
        else:
            assert f.name == "DONE" or f.name.endswith(".tmp"), f


def in_process_args(tmp_path, *extra):
    """Flags for train() in this process (one rank, no MPI): a tiny float64 run."""
    from llmz.train import parse_args
    args, _ = parse_args(["--device", "cpu", "--precision", "fp64", "--model", "tiny", "-b", "2", "-t", "8",
                          "--max-seq-len", "16", "--val-batches", "1", "--sample-tokens", "4", "--quiet", *extra],
                         kind="cpu")
    return args


def train_here(args) -> dict:
    from llmz.run.loop import train
    return train(args, "cpu", RankInfo(0, 1, 0, 1, "here"))


@pytest.mark.parametrize("which", ["model", "state"])
def test_a_write_failing_mid_file_keeps_the_previous_checkpoint_and_leaves_no_partial_file(
        tmp_path, monkeypatch, which):
    ck = tmp_path / "ck"
    real_part, real_write_state = llmz.files._write_part, llmz.run.state.write_state
    armed = []

    def disk_full_halfway(f, part):
        if armed:      # half of the piece reaches the disk, then the disk is full
            raw = memoryview(np.ascontiguousarray(part)).cast("B") if isinstance(part, np.ndarray) else part
            f.write(raw[:len(raw) // 2])
            raise OSError(28, "No space left on device")
        real_part(f, part)

    def save_model_then_arm(*a, **k):
        if "step_000004" in a[0] and which == "model":
            armed.append(1)
        return real_save_model(*a, **k)

    def write_state_then_arm(path, meta, arrays):
        if meta["step"] == 4 and which == "state":
            armed.append(1)
        return real_write_state(path, meta, arrays)

    real_save_model = llmz.run.model_file.save_model
    monkeypatch.setattr(llmz.files, "_write_part", disk_full_halfway)
    monkeypatch.setattr(llmz.run.model_file, "save_model", save_model_then_arm)
    monkeypatch.setattr(llmz.run.state, "write_state", write_state_then_arm)
    with pytest.raises(LlmzError, match="No space left on device") as e:
        train_here(in_process_args(tmp_path, "--steps", "6", "--checkpoint-dir", str(ck),
                                   "--checkpoint-every", "2"))
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    # the failed checkpoint is not complete, holds no partial file under a final name and no temporary file
    failed = Path(step_dir(ck, 4))
    assert not (failed / "DONE").exists()
    assert not list(failed.glob("*.tmp"))
    assert not (failed / "state_rank0.bin").exists()
    if which == "model":
        assert not (failed / "model.bin").exists()
    else:
        load_model(str(failed / "model.bin"))               # written whole before the fault
    # the previous one loads, and training resumes from it to the end
    assert latest_checkpoint(str(ck)) == step_dir(ck, 2)
    assert load_checkpoint(step_dir(ck, 2)).step == 2
    out = train_here(in_process_args(tmp_path, "--steps", "6", "--checkpoint-dir", str(ck), "--resume"))
    assert latest_checkpoint(str(ck)) == step_dir(ck, 6) and out["final_loss"] is not None


def test_a_non_finite_loss_stops_with_its_step_and_unmarks_the_checkpoint_that_gave_it(tmp_path, monkeypatch):
    """Step 3's loss comes from the parameters after 3 updates, which checkpoint step_000003 holds: the run
    stops naming step 3, and that checkpoint loses its DONE, so --resume picks step_000002."""
    from llmz.trainer import Trainer
    real_step = Trainer.step

    def step_nan_at_3(self, step):
        out = real_step(self, step)
        return {**out, "loss": float("nan")} if step == 3 else out
    monkeypatch.setattr(Trainer, "step", step_nan_at_3)
    ck = tmp_path / "ck"
    with pytest.raises(LlmzError, match="^step 3: non-finite loss nan") as e:
        train_here(in_process_args(tmp_path, "--steps", "6", "--checkpoint-dir", str(ck),
                                   "--checkpoint-every", "1"))
    assert f"last good checkpoint: {step_dir(ck, 2)}" in str(e.value) and "\n" not in str(e.value)
    assert [(s, done) for s, _, done in checkpoints(str(ck))] == [(1, True), (2, True), (3, False)]
    assert load_checkpoint(latest_checkpoint(str(ck))).step == 2


def test_keep_leaves_the_newest_k_complete_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    train_here(in_process_args(tmp_path, "--steps", "5", "--checkpoint-dir", str(ck),
                               "--checkpoint-every", "1", "--keep", "2"))
    assert [(s, done) for s, _, done in checkpoints(str(ck))] == [(4, True), (5, True)]


def test_one_command_line_starts_afresh_then_resumes_then_has_nothing_to_do(tmp_path, capsys):
    """`--init-from F --resume --checkpoint-dir D`: the first launch starts from F (no checkpoint yet), a
    relaunch continues from D's latest checkpoint, and a finished run trains nothing."""
    from llmz.config import preset
    init = str(tmp_path / "init.bin")
    lay = Layout(preset("tiny", vocab_size=256, max_seq_len=16), 1)
    save_model(init, lay.config, init_parameters(lay, 3), lay)
    ck = tmp_path / "ck"
    flags = ["--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--init-from", init, "--resume"]
    train_here(in_process_args(tmp_path, "--steps", "2", *flags))
    assert "no complete checkpoint" in capsys.readouterr().out
    out = train_here(in_process_args(tmp_path, "--steps", "3", *flags))
    text = capsys.readouterr().out
    assert "resume: step 2 from" in text and "--init-from" in text and "is not used" in text
    assert out["first_loss"] is not None and latest_checkpoint(str(ck)) == step_dir(ck, 3)
    out = train_here(in_process_args(tmp_path, "--steps", "3", *flags))
    assert "nothing to train" in capsys.readouterr().out and out["first_loss"] is None


def test_resume_refuses_another_model_and_both_resume_and_init_from(tmp_path):
    ck = tmp_path / "ck"
    train_here(in_process_args(tmp_path, "--steps", "1", "--checkpoint-dir", str(ck)))
    with pytest.raises(LlmzError, match="do not describe the model of checkpoint"):
        train_here(in_process_args(tmp_path, "--steps", "2", "--resume", step_dir(ck, 1), "--model", "d2"))
    with pytest.raises(LlmzError, match="choose one"):
        train_here(in_process_args(tmp_path, "--steps", "2", "--resume", step_dir(ck, 1),
                                   "--init-from", str(Path(step_dir(ck, 1)) / "model.bin")))


def test_a_configuration_that_cannot_fit_is_refused_with_predicted_and_available_bytes():
    from llmz.memory import GPU_RESERVE_BYTES, check_fits, predicted
    pred = predicted(Layout(GPT2Config(), 1), 0, 16, 1024, 4)          # d12, B=16, T=1024, fp32
    need = sum(pred.values())
    check_fits(pred, free=need + GPU_RESERVE_BYTES, total=140 << 30)   # exactly enough: accepted
    with pytest.raises(LlmzError) as e:
        check_fits(pred, free=need + GPU_RESERVE_BYTES - 1, total=140 << 30, gpu_index=3)
    msg = str(e.value)
    assert "\n" not in msg and "GPU 3" in msg and "predicted" in msg and "available" in msg, msg
    assert "140.00 GiB" in msg


def test_train_command_ends_with_one_error_line_on_a_corrupted_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    train_here(in_process_args(tmp_path, "--steps", "1", "--checkpoint-dir", str(ck)))
    state = Path(state_path(step_dir(ck, 1), 0))
    raw = bytearray(state.read_bytes())
    raw[-5] ^= 0x40                                   # one bit of v
    state.write_bytes(bytes(raw))
    env = dict(os.environ, PYTHONPATH=str(REPO), NUMBA_ENABLE_CUDASIM="1")
    p = subprocess.run([sys.executable, "-m", "llmz.train", "--device", "cpu", "--precision", "fp64",
                        "-b", "2", "-t", "8", "--steps", "2", "--resume", step_dir(ck, 1)],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip() == f"error: {state}: array v is corrupt (CRC-32 mismatch)", p.stderr
